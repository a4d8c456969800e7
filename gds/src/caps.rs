//! What this machine can do, found once at start-up: a CUDA driver with a
//! device, and GPUDirect Storage (cuFile). Absence is a value, never a
//! panic: cudarc panics when it cannot load a library, so every probe checks
//! for the library first and runs under `catch_unwind` as a second guard.

/// Whether CUDA is usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaSupport {
    /// No usable driver or device; the reason says which.
    Absent {
        /// Why, for logs and `kvtier bench gds`.
        reason: String,
    },
    /// A driver with at least one device.
    Present {
        /// Devices the driver reports.
        devices: u32,
    },
}

/// Whether GPUDirect Storage (cuFile) is usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GdsSupport {
    /// Not usable; the reason says why.
    Absent {
        /// Why.
        reason: String,
    },
    /// `cuFileDriverOpen` succeeded.
    Present,
}

/// Capabilities found at start-up; the planner's input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// CUDA driver and devices.
    pub cuda: CudaSupport,
    /// GPUDirect Storage.
    pub gds: GdsSupport,
}

/// Environment variable that turns GDS off (`KVTIER_GDS=off`), for
/// containers where cuFile loads but fails.
pub const GDS_ENV: &str = "KVTIER_GDS";

impl Capabilities {
    /// No GPU at all: host memory stands in for HBM.
    pub fn host_only(reason: impl Into<String>) -> Self {
        let reason = reason.into();
        Capabilities {
            cuda: CudaSupport::Absent {
                reason: reason.clone(),
            },
            gds: GdsSupport::Absent { reason },
        }
    }

    /// Probes the driver and cuFile. Never panics.
    pub fn probe() -> Self {
        let cuda = probe_cuda();
        let gds = match &cuda {
            CudaSupport::Absent { .. } => GdsSupport::Absent {
                reason: "no CUDA device".into(),
            },
            CudaSupport::Present { .. } => {
                if std::env::var(GDS_ENV).is_ok_and(|v| v.eq_ignore_ascii_case("off")) {
                    GdsSupport::Absent {
                        reason: format!("{GDS_ENV}=off"),
                    }
                } else {
                    probe_gds()
                }
            }
        };
        let caps = Capabilities { cuda, gds };
        tracing::info!(?caps, "kvtier-gds capabilities");
        caps
    }

    /// True when a CUDA device is usable.
    pub fn has_cuda(&self) -> bool {
        matches!(self.cuda, CudaSupport::Present { .. })
    }

    /// True when GPUDirect Storage is usable.
    pub fn has_gds(&self) -> bool {
        matches!(self.gds, GdsSupport::Present)
    }

    /// The same capabilities with GDS switched off (to force the bounce
    /// path, e.g. to measure both plans).
    pub fn without_gds(mut self, reason: impl Into<String>) -> Self {
        self.gds = GdsSupport::Absent {
            reason: reason.into(),
        };
        self
    }

    /// One line for people and reports.
    pub fn describe(&self) -> String {
        let c = match &self.cuda {
            CudaSupport::Present { devices } => format!("cuda: {devices} device(s)"),
            CudaSupport::Absent { reason } => format!("cuda: absent ({reason})"),
        };
        let g = match &self.gds {
            GdsSupport::Present => "gds: present".to_string(),
            GdsSupport::Absent { reason } => format!("gds: absent ({reason})"),
        };
        format!("{c}; {g}")
    }
}

#[cfg(feature = "cuda")]
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(feature = "cuda")]
fn probe_cuda() -> CudaSupport {
    let r = std::panic::catch_unwind(|| -> Result<u32, String> {
        // SAFETY: only tries to dlopen the library and drops it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("CUDA driver library (libcuda) not found".into());
        }
        cudarc::driver::result::init().map_err(|e| format!("cuInit: {e}"))?;
        let n = cudarc::driver::result::device::get_count()
            .map_err(|e| format!("cuDeviceGetCount: {e}"))?;
        if n <= 0 {
            return Err("the driver reports no CUDA device".into());
        }
        Ok(n as u32)
    });
    match r {
        Ok(Ok(devices)) => CudaSupport::Present { devices },
        Ok(Err(reason)) => CudaSupport::Absent { reason },
        Err(p) => CudaSupport::Absent {
            reason: format!("CUDA probe panicked: {}", panic_text(p)),
        },
    }
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda() -> CudaSupport {
    CudaSupport::Absent {
        reason: "built without the `cuda` feature".into(),
    }
}

#[cfg(feature = "cuda")]
fn probe_gds() -> GdsSupport {
    let r = std::panic::catch_unwind(|| -> Result<(), String> {
        // SAFETY: only tries to dlopen the library and drops it.
        if !unsafe { cudarc::cufile::sys::is_culib_present() } {
            return Err("cuFile library (libcufile) not found".into());
        }
        cudarc::cufile::result::driver_open().map_err(|e| format!("cuFileDriverOpen: {e:?}"))
    });
    match r {
        Ok(Ok(())) => GdsSupport::Present,
        Ok(Err(reason)) => GdsSupport::Absent { reason },
        Err(p) => GdsSupport::Absent {
            reason: format!("cuFile probe panicked: {}", panic_text(p)),
        },
    }
}

#[cfg(not(feature = "cuda"))]
fn probe_gds() -> GdsSupport {
    GdsSupport::Absent {
        reason: "built without the `cuda` feature".into(),
    }
}
