//! kvtier-gds: moves verified block bytes from G3 block files into host,
//! pinned or GPU memory, as directly as the hardware allows.
//!
//! - [`memory`]: memory kinds, aligned host buffers, [`Destination`]
//!   (one region, or one per layer for layer-separate layouts).
//! - [`caps`]: what the machine can do, probed once, never panicking.
//! - [`plan`]: the pure planner: (source, destination, capabilities) ->
//!   [`Route`] (Direct GDS, TwoHop bounce, host read).
//! - [`transfer`]: the executor with checksum verification and fallback.
//! - [`keyed`]: onboard and offload by key against kvtierd through the
//!   executor (fds the daemon passes in; a gather with async copies out):
//!   the Python client's CUDA path.
//! - `cuda` (feature `cuda`): the only CUDA `unsafe` in kvtier.
//!
//! Without a GPU the same pipeline runs with host memory standing in for
//! HBM ([`Destination::emulated`]).

pub mod buffer;
pub mod caps;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod keyed;
pub mod memory;
pub mod plan;
pub mod transfer;

pub use buffer::BlockBuf;
pub use caps::{Capabilities, CudaSupport, GdsSupport};
pub use error::{Error, Result};
pub use keyed::{Gather, KeyedOnboard, SrcRegion};
pub use memory::{Destination, DeviceSpan, HostBuf, MemoryKind, Region};
pub use plan::{plan, Plan, Route, Source};
pub use transfer::{OnboardJob, Outcome, Transfer, TransferConfig};
