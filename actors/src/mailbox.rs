//! The mailbox idiom of the stages that run on their own threads (the router and the
//! Vulkan executor): they block — on gate math, on GPU fences — so they are thread
//! actors, not tokio tasks. A [`ThreadActor`] owns its state on a named thread and
//! serves one request at a time from a bounded flume mailbox; the caller sends a plain
//! message (moved, never copied) and waits for the reply. Both sides poll briefly
//! before blocking (the caller about as long as its last call took, up to 2 ms), since a
//! decode step calls once per layer and a thread wake-up costs about as much as the work.
//!
//! The scheduler stays a kameo actor on tokio (it only queues and hands out work); the
//! streamer's threads drain its priority queue of read requests (see `streamer`).

use std::cell::Cell;
use std::marker::PhantomData;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long either side polls its mailbox before blocking, at least.
const POLL: Duration = Duration::from_micros(50);

/// How long a caller polls for a reply at most: it polls for about as long as the last
/// call took (a GPU decode step, ~1 ms, whose wake-up would otherwise cost ~5% of it)
/// when that was at most this, else [`POLL`] (a slow device's steps block at once).
const MAX_POLL: Duration = Duration::from_millis(2);

/// The thread is gone (it panicked, failed to start, or was shut down).
#[derive(Debug, thiserror::Error)]
#[error("the {0} thread has stopped")]
pub struct Stopped(pub &'static str);

/// A stage thread serving requests of type `Req` with replies of type `Rep`.
/// One caller at a time: the handle is `Send` but not `Sync`, so a reply always goes to
/// the call that is waiting for it.
pub struct ThreadActor<Req, Rep> {
    name: &'static str,
    requests: Option<flume::Sender<Req>>,
    replies: flume::Receiver<Rep>,
    thread: Option<JoinHandle<()>>,
    /// How long the last call took (the caller's next poll).
    last: Cell<Duration>,
    _one_caller: PhantomData<Cell<()>>,
}

impl<Req: Send + 'static, Rep: Send + 'static> ThreadActor<Req, Rep> {
    /// Starts thread `name`: it builds its state with `init` (on the thread, so the state
    /// need not be `Send`), reports `init`'s failure, then answers each request with
    /// `handle` until the actor is dropped.
    pub fn spawn<S, E: Send + 'static>(
        name: &'static str,
        init: impl FnOnce() -> Result<S, E> + Send + 'static,
        mut handle: impl FnMut(&mut S, Req) -> Rep + Send + 'static,
    ) -> Result<Self, SpawnError<E>> {
        let (requests, inbox) = flume::bounded::<Req>(1);
        let (reply, replies) = flume::bounded::<Rep>(1);
        let (ready_tx, ready) = flume::bounded::<Result<(), E>>(1);
        let thread = std::thread::Builder::new()
            .name(format!("smoe-{name}"))
            .spawn(move || {
                let mut state = match init() {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                while let Ok(req) = recv_polling(&inbox, POLL) {
                    if reply.send(handle(&mut state, req)).is_err() {
                        break;
                    }
                }
            })
            .map_err(SpawnError::Thread)?;
        match ready.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(SpawnError::Init(e)),
            Err(_) => return Err(SpawnError::Died),
        }
        Ok(ThreadActor {
            name,
            requests: Some(requests),
            replies,
            thread: Some(thread),
            last: Cell::new(Duration::ZERO),
            _one_caller: PhantomData,
        })
    }

    /// Sends `req` and waits for the reply. Once the thread has stopped, every call
    /// fails.
    pub fn call(&self, req: Req) -> Result<Rep, Stopped> {
        let start = Instant::now();
        let last = self.last.get();
        let poll = if last <= MAX_POLL { (last + last / 4).clamp(POLL, MAX_POLL) } else { POLL };
        let sent = self.requests.as_ref().is_some_and(|tx| tx.send(req).is_ok());
        let reply = sent.then(|| recv_polling(&self.replies, poll).ok()).flatten().ok_or(Stopped(self.name));
        self.last.set(start.elapsed());
        reply
    }
}

impl<Req, Rep> Drop for ThreadActor<Req, Rep> {
    fn drop(&mut self) {
        self.requests = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Why a [`ThreadActor`] did not start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError<E> {
    /// The OS refused the thread.
    #[error("starting a thread: {0}")]
    Thread(std::io::Error),
    /// The state could not be built.
    #[error(transparent)]
    Init(E),
    /// The thread died while building its state.
    #[error("the thread died while starting")]
    Died,
}

/// Receives from `rx`, polling for `poll` before blocking.
fn recv_polling<T>(rx: &flume::Receiver<T>, poll: Duration) -> Result<T, flume::RecvError> {
    let until = Instant::now() + poll;
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(flume::TryRecvError::Disconnected) => return Err(flume::RecvError::Disconnected),
            Err(flume::TryRecvError::Empty) if Instant::now() < until => std::hint::spin_loop(),
            Err(flume::TryRecvError::Empty) => return rx.recv(),
        }
    }
}
