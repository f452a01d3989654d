#!/usr/bin/env bash
# Run the unit tests that exercise unsafe code and the pool's state machine under Miri.
#
#   rustup component add --toolchain nightly miri rust-src   # once
#   scripts/miri.sh [extra cargo-miri args]
#
# Miri interprets every step, so only tests sized for it are listed (big randomized tests
# shrink under cfg(miri) or are left out). Keep one test-name filter per line in FILTERS:
# each is a substring of the test paths it selects (`cargo test` filter semantics).
set -euo pipefail
cd "$(dirname "$0")/.."

FILTERS=$(cat <<'LIST'
alloc::tests::
alloc::idset::tests::
alloc::block::tests::
boundary::tests::
checkpoint::tests::
pool::tests::
LIST
)

# libtest takes several filters at once: one Miri build, one run.
mapfile -t filters < <(grep -v '^[[:space:]]*$' <<<"$FILTERS")
exec cargo +nightly miri test --lib "$@" -- "${filters[@]}"
