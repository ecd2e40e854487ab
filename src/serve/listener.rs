//! The HTTP/1.1 server loop: accepts up to `max_connections` connections (beyond that a
//! connection gets a JSON 503 and is closed), serves each with hyper, and closes it when
//! a request's head is slower than `header_read_timeout` (counted from its first byte)
//! or when it sits idle, with no request in progress, for `idle_timeout` (a fresh
//! connection that sends nothing included). Request bodies are timed by the handlers
//! (`body_read_timeout`, see `admission`). On shutdown it stops accepting, lets every
//! connection finish its request in progress, and returns once all are closed.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

use super::error::ApiError;

/// Connection limits (`max_connections`, `header_read_timeout`, `idle_timeout`).
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Open connections at once.
    pub max_connections: usize,
    /// Time for a request head to arrive once its first byte has.
    pub header_read_timeout: Duration,
    /// Time a connection may sit with no request in progress.
    pub idle_timeout: Duration,
}

/// Serves `app` on `listener` until `stop` turns true, then waits for the open
/// connections to finish.
pub async fn serve(listener: TcpListener, app: Router, limits: ConnLimits, mut stop: watch::Receiver<bool>) {
    let open = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            refuse(&stream, limits.max_connections);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (app, stop) = (app.clone(), stop.clone());
        tokio::spawn(async move {
            connection(stream, app, limits, stop).await;
            drop(permit);
        });
    }
    // Every connection holds a permit until it closes.
    let _ = open.acquire_many(limits.max_connections as u32).await;
}

/// Answers a connection over the limit with a 503 (if the socket takes it at once) and
/// closes it.
fn refuse(stream: &TcpStream, max: usize) {
    tracing::warn!("refusing a connection: {max} are open (`max_connections`)");
    let e = ApiError::too_many_connections(max);
    let body = e.body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.try_write(format!("{head}{body}").as_bytes());
}

/// What a connection is doing, for its timeouts.
struct Activity {
    state: Mutex<ActivityState>,
    changed: Notify,
}

struct ActivityState {
    /// Requests whose response is not finished.
    in_flight: usize,
    /// When the connection last became idle (accepted, or its last response ended).
    idle_since: Instant,
    /// When the first byte of the next request arrived, while idle.
    head_started: Option<Instant>,
}

impl Activity {
    fn lock(&self) -> std::sync::MutexGuard<'_, ActivityState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// When the connection times out as things stand (`None`: a request is running).
    fn deadline(&self, limits: &ConnLimits) -> Option<Instant> {
        let s = self.lock();
        match (s.in_flight, s.head_started) {
            (0, Some(t)) => Some(t + limits.header_read_timeout),
            (0, None) => Some(s.idle_since + limits.idle_timeout),
            _ => None,
        }
    }

    /// Bytes arrived from the client.
    fn read(&self) {
        let mut s = self.lock();
        if s.in_flight == 0 && s.head_started.is_none() {
            s.head_started = Some(Instant::now());
            drop(s);
            self.changed.notify_one();
        }
    }

    /// A request head was parsed; the returned guard ends the request when dropped.
    fn request(self: &Arc<Self>) -> InFlight {
        let mut s = self.lock();
        s.in_flight += 1;
        s.head_started = None;
        drop(s);
        self.changed.notify_one();
        InFlight(self.clone())
    }
}

/// A request in progress; dropped when its response body ends (or is abandoned).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.in_flight -= 1;
        s.idle_since = Instant::now();
        drop(s);
        self.0.changed.notify_one();
    }
}

/// The socket, reporting reads to the connection's [`Activity`].
struct Watched {
    io: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A response body that ends its request's [`InFlight`] when it is done or dropped.
struct Tracked {
    body: Body,
    _request: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Serves one connection until it closes, times out, or finishes after shutdown.
async fn connection(stream: TcpStream, app: Router, limits: ConnLimits, mut stop: watch::Receiver<bool>) {
    let activity = Arc::new(Activity {
        state: Mutex::new(ActivityState { in_flight: 0, idle_since: Instant::now(), head_started: None }),
        changed: Notify::new(),
    });
    let io = TokioIo::new(Watched { io: stream, activity: activity.clone() });
    let tracker = activity.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let request = tracker.request();
        let app = app.clone();
        async move {
            let resp = app.oneshot(req.map(Body::new)).await.unwrap_or_else(|e| match e {});
            Ok::<_, std::convert::Infallible>(resp.map(|body| Tracked { body, _request: request }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    let mut stopping = false;
    loop {
        let deadline = activity.deadline(&limits);
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            _ = activity.changed.notified() => {}
            _ = sleep_until(deadline) => {
                if activity.deadline(&limits).is_some_and(|d| d <= Instant::now()) {
                    tracing::debug!("closing a connection: header_read_timeout or idle_timeout");
                    return;
                }
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
