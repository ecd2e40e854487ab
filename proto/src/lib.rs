//! Types shared by every smoe-pipeline stage: the model configuration, the vault's
//! on-disk format, expert identities, the handles that carry expert bytes between
//! stages without copying them, the snapshots of engine state the engine publishes, and
//! the names of the metrics it exports.

pub mod error;
pub mod ggml;
pub mod handle;
pub mod job;
pub mod messages;
pub mod metric_names;
pub mod model_config;
pub mod route;
pub mod stats;
pub mod vault_format;

pub use error::VaultError;
pub use ggml::GgmlType;
pub use handle::{ExpertHandle, ExpertKey, ExpertSource, Lookahead, SlotOwner};
pub use job::{FinishReason, GenerateStats, JobEvent, JobFailure};
pub use messages::{ClaimEvent, ClaimInfo, ClaimTally, Priority, ReadRequest};
pub use model_config::{HybridConfig, LayerType, ModelConfig};
pub use route::{GateInput, RouteJob};
pub use stats::{RingSnapshot, VramSnapshot};
pub use vault_format::{
    align_up, human_bytes, tensor_bytes, BlobEntry, DType, ExpertIndex, ExpertLayout, FormatShare,
    LayerBlobs, Manifest, PartLayout, ResidentIndex, TensorEntry, BLOB_ALIGN, FORMAT_VERSION, MANIFEST_FILE,
};
