//! DSpark window gather (`index-buffers.md` §9).
