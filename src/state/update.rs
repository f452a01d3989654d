//! Compressor-state update (`index-buffers.md` §8).
