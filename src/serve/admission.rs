//! What a generation request goes through before it reaches the scheduler: it is refused
//! once the vault's background check found corrupt resident tensors, its body is read
//! within `max_body_bytes` and `body_read_timeout`, and the CPU work on it (JSON parsing,
//! chat template, the prompt's byte-length check, tokenizing) runs on the blocking pool
//! behind a semaphore, never on the async runtime's threads.

use std::time::Duration;

use std::sync::Arc;

use axum::body::{Body, Bytes};
use futures_util::StreamExt;
use smoe_actors::vault::integrity::ResidentCheck;
use tokenizers::Tokenizer;
use tokio::sync::Semaphore;

use super::error::ApiError;
use super::prompt_bound::PromptBound;
use crate::settings::ByteSize;

/// Request intake limits and the tokenizing pool, shared by the completion handlers.
pub struct Admission {
    /// Largest request body accepted (`max_body_bytes`).
    pub max_body: ByteSize,
    /// Time allowed to receive a request body (`body_read_timeout`).
    pub body_timeout: Duration,
    /// Bytes-to-tokens bound of the tokenizer, for refusing oversized prompts unread.
    pub bound: PromptBound,
    /// The background checksum verification of the served vault's resident tensors.
    pub integrity: Arc<ResidentCheck>,
    /// Permits for prompt preparation on the blocking pool (one per CPU).
    workers: Semaphore,
}

impl Admission {
    /// Intake limits for prompts tokenized by `tok`, on a vault checked by `integrity`.
    pub fn new(
        max_body: ByteSize,
        body_timeout: Duration,
        tok: &Tokenizer,
        integrity: Arc<ResidentCheck>,
    ) -> Admission {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let bound = PromptBound::of(tok);
        Admission { max_body, body_timeout, bound, integrity, workers: Semaphore::new(cpus) }
    }

    /// `Err` (500, detail logged) once the vault is known to be corrupt.
    pub fn vault_ok(&self) -> Result<(), ApiError> {
        match self.integrity.status() {
            Some(Err(e)) => Err(ApiError::internal(e)),
            _ => Ok(()),
        }
    }

    /// Reads `body` whole: 413 past `max_body`, 408 past `body_timeout`.
    pub async fn read_body(&self, body: Body) -> Result<Bytes, ApiError> {
        let limit = self.max_body.0;
        if axum::body::HttpBody::size_hint(&body).lower() > limit {
            return Err(ApiError::body_too_large(self.max_body));
        }
        let read = async {
            let mut data = body.into_data_stream();
            let mut buf = Vec::new();
            while let Some(chunk) = data.next().await {
                let chunk =
                    chunk.map_err(|e| ApiError::bad_body(format!("cannot read the request body: {e}")))?;
                if (buf.len() + chunk.len()) as u64 > limit {
                    return Err(ApiError::body_too_large(self.max_body));
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(Bytes::from(buf))
        };
        tokio::time::timeout(self.body_timeout, read)
            .await
            .unwrap_or(Err(ApiError::body_timeout(self.body_timeout)))
    }

    /// Runs `work` on the blocking pool once one of the per-CPU permits is free.
    pub async fn off_runtime<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let _permit =
            self.workers.acquire().await.map_err(|_| ApiError::internal("the prompt workers are closed"))?;
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| ApiError::internal(format!("prompt preparation failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn admission() -> Admission {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/moe_all/tokenizer.json");
        let tok = Tokenizer::from_file(path).unwrap();
        let map = Arc::new(memmap2::MmapMut::map_anon(1).unwrap().make_read_only().unwrap());
        let nothing = ResidentCheck::start(map, Vec::new(), "resident.bin".into());
        Admission::new(ByteSize(1 << 10), Duration::from_millis(200), &tok, nothing)
    }

    /// On a one-thread runtime, a timer keeps ticking while prompt work runs: the work
    /// is not on the runtime's thread.
    #[test]
    fn prompt_work_leaves_the_runtime_free() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let adm = admission();
            let start = Instant::now();
            let work = adm.off_runtime(|| std::thread::sleep(Duration::from_millis(600)));
            let ticker = async {
                for _ in 0..10 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                start.elapsed()
            };
            let (done, ticked) = tokio::join!(work, ticker);
            done.unwrap();
            assert!(ticked < Duration::from_millis(400), "the runtime stalled for {ticked:?}");
        });
    }

    #[test]
    fn bodies_are_read_within_size_and_time() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let adm = admission();
            assert_eq!(adm.read_body(Body::from("{}")).await.unwrap(), "{}");
            assert_eq!(adm.read_body(Body::from(vec![b' '; 2000])).await.unwrap_err().status, 413);
            let never = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
            assert_eq!(adm.read_body(Body::from_stream(never)).await.unwrap_err().status, 408);
        });
    }
}
