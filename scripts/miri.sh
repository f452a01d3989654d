#!/usr/bin/env bash
# Run the unit tests that exercise unsafe code and the pool's state machine under Miri.
#
#   rustup component add --toolchain nightly miri rust-src   # once
#   scripts/miri.sh [extra cargo-miri args]
#
# Miri interprets every step, so only tests sized for it are listed (big randomized tests
# shrink under cfg(miri) or are left out: checkpoint::tests is pure integer planning with no
# unsafe code, and its worked examples run for over ten minutes under Miri).
# Keep one test-name filter per line in FILTERS: each is a substring of the test paths it
# selects (`cargo test` filter semantics).
set -euo pipefail
cd "$(dirname "$0")/.."

FILTERS=$(cat <<'LIST'
pool::tests::
alloc::tests::
alloc::idset::tests::
alloc::block::tests::
boundary::tests::
backend::host::
backend::launch::
backend::staging::
index::bounds::
index::host::tests::raw_
checked::
LIST
)

# libtest takes several filters at once: one Miri build, one run.
mapfile -t filters < <(grep -v '^[[:space:]]*$' <<<"$FILTERS")
exec cargo +nightly miri test --lib "$@" -- "${filters[@]}"
