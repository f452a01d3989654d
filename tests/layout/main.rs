//! The `layout` suite: what the crate computes before any kernel runs. Geometry (worked
//! examples, properties, the external oracle), sizing, the allocators and arenas, pools (plan,
//! properties, misuse, threads, packed formats), row formats and the launch-struct layouts
//! against the kernel header, model configs and their bounds, V4.1's geometry and model.
//!
//! One test binary of several files (`mod` each; tests/README.md). Helpers shared with other
//! suites are included from `tests/<helper>/` by path. `alloc_speed` installs this binary's
//! global allocator (it counts allocations per thread and forwards each call to the system
//! allocator, so the other files' tests are unaffected).

#[path = "../common/mod.rs"]
mod common;
#[path = "../pool_common/mod.rs"]
mod pool_common;

mod alloc_props;
mod alloc_speed;
mod arena_checkpoint_copy;
mod arena_props;
mod config_bounded;
mod geometry_oracle;
mod geometry_props;
mod geometry_worked;
mod host_backend_memory;
mod kernel_layout;
mod model_config;
mod packed_pool;
mod pool_concurrency;
mod pool_plan;
mod pool_props;
mod pool_sound;
mod row_formats;
mod sizing_props;
mod v41_geometry;
mod v41_model;
mod variant_names;
