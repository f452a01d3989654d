//! The host backend (being written).
