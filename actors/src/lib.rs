//! The engine of smoe-pipeline. The five stages — [`scheduler`] (requests, sessions,
//! chunking), [`router`] (gate, top-k, union), [`streamer`] (vault reads), [`ring`] (slot
//! ownership, states, LRU) and [`executor`] (the model on a backend) — each live in one
//! module. [`model`] holds the model definitions, written once over the operations of
//! [`contract`]; [`cpu`] and [`vulkan`] are the backends, peers that never import each
//! other (both keep their DeltaNet state snapshots by [`state_book`]).

pub mod blob_check;
pub mod contract;
pub mod cpu;
pub mod engine;
pub mod executor;
pub mod generation;
pub mod mailbox;
pub mod model;
pub mod profile;
pub mod ring;
pub mod router;
pub mod sampler;
pub mod scheduler;
pub mod state_book;
pub mod streamer;
pub mod tensor;
pub mod vault;
#[cfg(feature = "vulkan")]
pub mod vulkan;
