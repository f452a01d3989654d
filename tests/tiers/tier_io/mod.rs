//! The I/O a shared tier's bytes go through, as a parameter of the shared-tier suites
//! (`tests/tiers/shared_tier.rs`, `tests/tiers/shared_tier_fleet.rs`): each test body runs once per
//! [`Io`] (`per_io!`), and a child process is told which by `$V4POOL_TIER_IO`.
//!
//! `Io::NixlPosix` needs NIXL's C API (`$V4POOL_NIXL_LIB`, docs/nixl.md): without it its tests
//! print SKIP, or fail with `V4POOL_REQUIRE_NIXL=1` (CI's NIXL step).
#![allow(dead_code)]

use v4pool::manager::KvManager;
use v4pool::pool::Pool;
use v4pool::transfer::{HostTierError, NixlPosix, SharedTier, SharedTierConfig, StdFs, TierIo};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Io {
    /// `std::fs` ([`StdFs`]).
    StdFs,
    /// NIXL's POSIX plugin ([`NixlPosix`]).
    NixlPosix,
}

impl Io {
    pub fn name(self) -> &'static str {
        match self {
            Io::StdFs => "std-fs",
            Io::NixlPosix => "nixl-posix",
        }
    }

    /// What a parent process said in `$V4POOL_TIER_IO` (`std-fs` when unset).
    pub fn from_env() -> Io {
        match std::env::var("V4POOL_TIER_IO").as_deref() {
            Ok("nixl-posix") => Io::NixlPosix,
            Ok("std-fs") | Err(_) => Io::StdFs,
            Ok(other) => panic!("V4POOL_TIER_IO={other}: not an I/O of the tests"),
        }
    }

    /// Whether `test` can run with this I/O here; prints why not (see the module docs).
    pub fn runs(self, test: &str) -> bool {
        if self == Io::StdFs {
            return true;
        }
        let Some(why) = v4pool::transfer::nixl::unavailable_reason() else { return true };
        let required = std::env::var("V4POOL_REQUIRE_NIXL").is_ok_and(|v| v == "1");
        assert!(!required, "{test}: V4POOL_REQUIRE_NIXL=1 but NIXL is unavailable: {why}");
        println!("SKIP: {test} over {}: NIXL unavailable ({why})", self.name());
        false
    }

    pub fn boxed(self) -> Box<dyn TierIo> {
        match self {
            Io::StdFs => Box::new(StdFs),
            Io::NixlPosix => Box::new(NixlPosix::from_env().expect("a NIXL agent with a POSIX backend")),
        }
    }

    /// A tier for `pool` over this I/O.
    pub fn tier(self, pool: &Pool, config: &SharedTierConfig) -> Result<SharedTier, HostTierError> {
        SharedTier::with_io(pool, config, self.boxed())
    }

    /// Replace `m`'s shared tier with one over this I/O (a manager built from a
    /// `ManagerConfig::shared_tier` has a [`StdFs`] one); for NIXL, a handle on the same
    /// agent (to check what it holds).
    pub fn install(self, m: &mut KvManager, config: &SharedTierConfig) -> Option<NixlPosix> {
        let (io, probe): (Box<dyn TierIo>, _) = match self {
            Io::StdFs => (Box::new(StdFs), None),
            Io::NixlPosix => {
                let n = NixlPosix::from_env().expect("a NIXL agent with a POSIX backend");
                (Box::new(n.clone()), Some(n))
            }
        };
        let t = SharedTier::with_io(m.pool(), config, io).expect("the shared tier");
        m.set_shared_tier(Some(Box::new(t))).expect("install the shared tier");
        probe
    }
}

/// One `#[test]` per I/O for each named `fn name(io: Io)` of the including file: modules
/// `std_fs` and `nixl_posix` (the NIXL ones skip visibly without the library).
#[macro_export]
macro_rules! per_io {
    ($($name:ident),* $(,)?) => {
        mod std_fs {
            $(#[test]
            fn $name() {
                super::$name(super::Io::StdFs)
            })*
        }
        mod nixl_posix {
            $(#[test]
            fn $name() {
                if super::Io::NixlPosix.runs(stringify!($name)) {
                    super::$name(super::Io::NixlPosix)
                }
            })*
        }
    };
}
