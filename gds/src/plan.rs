//! Transfer planning as a pure function: (source, destination kind,
//! capabilities) -> route. No I/O, no CUDA; the executor in
//! [`crate::transfer`] carries the plan out and may fall back at run time.

use crate::caps::Capabilities;
use crate::memory::MemoryKind;

/// Where the bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// A G3 block file (read with O_DIRECT, or by cuFile).
    G3File,
    /// Bytes already in host memory.
    HostBuffer,
}

/// How the bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// GPUDirect Storage: cuFile reads the file straight into HBM.
    Direct,
    /// O_DIRECT reads into pinned bounce buffers, then asynchronous
    /// host-to-device copies, pipelined over several buffers and streams.
    /// Without a GPU the bounce buffers are plain host memory and the
    /// "device" is host memory standing in for HBM.
    TwoHop,
    /// O_DIRECT reads into aligned bounce buffers, then host copies into
    /// host or pinned memory.
    HostRead,
    /// A host-to-host copy.
    HostCopy,
    /// A host-to-device copy.
    HostToDevice,
}

impl Route {
    /// Lowercase name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::TwoHop => "two_hop",
            Route::HostRead => "host_read",
            Route::HostCopy => "host_copy",
            Route::HostToDevice => "host_to_device",
        }
    }
}

/// A plan and why it was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The route.
    pub route: Route,
    /// Why, for logs.
    pub reason: &'static str,
}

/// Chooses the route. `prefer_direct` lets an operator or a benchmark turn
/// GDS off without re-probing.
pub fn plan(source: Source, dst: MemoryKind, caps: &Capabilities, prefer_direct: bool) -> Plan {
    let p = |route, reason| Plan { route, reason };
    match (source, dst) {
        (Source::G3File, MemoryKind::Host | MemoryKind::Pinned) => p(
            Route::HostRead,
            "host destination: O_DIRECT into bounce buffers",
        ),
        (Source::G3File, MemoryKind::Device) => {
            if !caps.has_cuda() {
                p(Route::TwoHop, "no CUDA: host memory stands in for HBM")
            } else if caps.has_gds() && prefer_direct {
                p(Route::Direct, "GPUDirect Storage available")
            } else if caps.has_gds() {
                p(Route::TwoHop, "GPUDirect Storage turned off")
            } else {
                p(Route::TwoHop, "no GPUDirect Storage: pinned bounce buffers")
            }
        }
        (Source::HostBuffer, MemoryKind::Host | MemoryKind::Pinned) => {
            p(Route::HostCopy, "host to host")
        }
        (Source::HostBuffer, MemoryKind::Device) => p(Route::HostToDevice, "host to device"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::{CudaSupport, GdsSupport};

    fn caps(cuda: bool, gds: bool) -> Capabilities {
        Capabilities {
            cuda: if cuda {
                CudaSupport::Present { devices: 1 }
            } else {
                CudaSupport::Absent { reason: "t".into() }
            },
            gds: if gds {
                GdsSupport::Present
            } else {
                GdsSupport::Absent { reason: "t".into() }
            },
        }
    }

    /// Every (source, destination, capabilities, preference) cell.
    #[test]
    fn table() {
        use MemoryKind::*;
        use Route::*;
        use Source::*;
        #[rustfmt::skip]
        let table = [
            // source,     dst,     cuda,  gds,   prefer, route
            (G3File,     Host,    false, false, true,  HostRead),
            (G3File,     Host,    true,  true,  true,  HostRead),
            (G3File,     Pinned,  false, false, true,  HostRead),
            (G3File,     Pinned,  true,  true,  true,  HostRead),
            (G3File,     Device,  false, false, true,  TwoHop),
            (G3File,     Device,  false, true,  true,  TwoHop),
            (G3File,     Device,  true,  false, true,  TwoHop),
            (G3File,     Device,  true,  true,  true,  Direct),
            (G3File,     Device,  true,  true,  false, TwoHop),
            (HostBuffer, Host,    false, false, true,  HostCopy),
            (HostBuffer, Host,    true,  true,  true,  HostCopy),
            (HostBuffer, Pinned,  true,  false, true,  HostCopy),
            (HostBuffer, Pinned,  false, false, true,  HostCopy),
            (HostBuffer, Device,  false, false, true,  HostToDevice),
            (HostBuffer, Device,  true,  false, true,  HostToDevice),
            (HostBuffer, Device,  true,  true,  true,  HostToDevice),
        ];
        for (src, dst, cuda, gds, prefer, want) in table {
            let got = plan(src, dst, &caps(cuda, gds), prefer);
            assert_eq!(
                got.route, want,
                "{src:?} -> {dst:?} cuda={cuda} gds={gds} prefer={prefer}: {}",
                got.reason
            );
        }
    }
}
