//! Host reference of every kernel (being written).
