//! The layers under the engine API, in one place: the kernel contract (`#[repr(C)]` launch
//! arguments, [`Launch`](index::Launch), grid shapes, launch bounds), the host reference of
//! every kernel, launch plumbing, the embedded kernel images, the allocators, the arena
//! layout, the boundary's moves, the bounded file reader and the profiling ranges.
//!
//! An engine does not need this module: the crate root and [`prelude`](crate::prelude) hold
//! what it uses, and the types those calls return are re-exported beside them (a pool's
//! handles in [`pool`](crate::pool), [`DevicePtr`](crate::backend::DevicePtr) and
//! [`Launch`](crate::backend::Launch) in [`backend`](crate::backend)). What is here is for
//! backends, benches, tests and tools (the `v4pool` command's checks, the emulation build): it
//! is public so they can reach it, and it follows the kernels, so it may change shape in any
//! 0.x release (cudarc's layering: `sys` under `result` under `safe`; this is v4pool's `sys`
//! and `result`).

/// The kernel contract: the `#[repr(C)]` by-value launch arguments the kernels declare,
/// [`Launch`](index::Launch) (one variant per kernel), grid shapes (`shape`), the host
/// backend's launch bounds (`bounds`) and the host reference of every kernel (`host`).
pub mod index {
    pub use crate::index::*;
}

/// The kernel source and binaries `build.rs` embedded.
pub mod kernels {
    pub use crate::kernels::*;
}

/// Launch plumbing shared by the device backends: a launch's by-value kernel argument.
pub mod launch {
    pub use crate::backend::launch::*;
}

/// The HIP backend's loader internals: code-object parsing, hiprtc, roctx.
pub mod hip {
    pub use crate::backend::hip::api::{hiprtc_compile, hiprtc_compile_source};
    /// Reading AMD GPU code objects (ELF) and offload bundles.
    pub mod elf {
        pub use crate::backend::hip::elf::*;
    }
    pub use crate::backend::hip::module::{embedded_code_objects, parse_arch_name};
    pub use crate::backend::hip::roctx::{roctx_pop, roctx_push};
}

/// Block and slot allocators: ids and groups, generation-checked handles, no kernels.
pub mod alloc {
    pub use crate::alloc::*;
}

/// The compressor-state fields of a slot and where they sit in its rows.
pub mod arena {
    pub use crate::arena::*;
}

/// The elastic block/slot boundary: grow, shrink, relocate, every relocation a move.
pub mod boundary {
    pub use crate::boundary::*;
}

/// The one bounded file reader.
pub mod file {
    pub use crate::file::*;
}

/// NVTX / roctx ranges around pool operations (no-ops without the `profiling` feature).
pub mod profiling {
    pub use crate::profiling::*;
}

/// The simulator's internals: the step loop (`Engine`, which `sim::simulate` drives), its
/// accounting pool, the host-memory reading its memory check uses, and the calibration replays.
pub mod sim {
    pub use crate::sim::engine::{available_memory, sim_pool, Engine};
    /// Replays of published benchmark cells (the step-cost model's calibration).
    pub mod bench {
        pub use crate::sim::bench::*;
    }
}
