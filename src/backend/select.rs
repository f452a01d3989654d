//! Backend choice: CUDA, HIP or host by what is present, explicit in the API and
//! overridable with `V4POOL_BACKEND=cuda|hip|host`.

use super::{Backend, BackendError, BackendKind, BackendResult};
use std::sync::Arc;

/// What the caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// `V4POOL_BACKEND` if set, else the first present of CUDA, HIP, host.
    Auto,
    /// Exactly this backend; an error if it is not present (never a silent fallback).
    Exactly(BackendKind),
}

impl BackendKind {
    /// Parse `cuda`, `hip` or `host`.
    pub fn parse(s: &str) -> BackendResult<BackendKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cuda" => Ok(BackendKind::Cuda),
            "hip" | "rocm" => Ok(BackendKind::Hip),
            "host" | "cpu" => Ok(BackendKind::Host),
            _ => Err(BackendError::UnknownBackendName { value: s.to_string() }),
        }
    }
}

impl BackendChoice {
    /// Parse `auto` or a backend's name ([`BackendKind::parse`]).
    pub fn parse(s: &str) -> BackendResult<BackendChoice> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(BackendChoice::Auto)
        } else {
            BackendKind::parse(s).map(BackendChoice::Exactly)
        }
    }
}

/// The environment's override, if any (`V4POOL_BACKEND`).
pub fn env_choice() -> BackendResult<Option<BackendKind>> {
    match std::env::var("V4POOL_BACKEND") {
        Ok(v) if !v.trim().is_empty() => BackendKind::parse(&v).map(Some),
        _ => Ok(None),
    }
}

/// Open one backend of `kind` on device 0.
pub fn open(kind: BackendKind) -> BackendResult<Arc<dyn Backend>> {
    open_on(kind, 0)
}

/// Open one backend of `kind` on device `device` (the host backend has one device, any
/// `device` names it).
pub fn open_on(kind: BackendKind, device: usize) -> BackendResult<Arc<dyn Backend>> {
    Ok(match kind {
        BackendKind::Host => Arc::new(super::host::HostBackend::new()),
        BackendKind::Cuda => Arc::new(super::cuda::CudaBackend::new(device)?),
        BackendKind::Hip => Arc::new(super::hip::HipBackend::new(device)?),
    })
}

/// Pick a backend: an explicit choice is honoured or fails; `Auto` follows
/// `V4POOL_BACKEND`, else takes CUDA, then HIP, then the host.
pub fn select(choice: BackendChoice) -> BackendResult<Arc<dyn Backend>> {
    let explicit = match choice {
        BackendChoice::Exactly(k) => Some(k),
        BackendChoice::Auto => env_choice()?,
    };
    if let Some(kind) = explicit {
        return open(kind);
    }
    if super::cuda::is_available() {
        if let Ok(b) = open(BackendKind::Cuda) {
            return Ok(b);
        }
    }
    if super::hip::HipBackend::is_available() {
        if let Ok(b) = open(BackendKind::Hip) {
            return Ok(b);
        }
    }
    open(BackendKind::Host)
}

/// [`select`] on device `device`: the kind is picked as [`select`] picks it, then opened on
/// `device` (a device the kind lacks is that backend's error, never a fallback to another
/// kind).
pub fn select_on(choice: BackendChoice, device: usize) -> BackendResult<Arc<dyn Backend>> {
    let kind = match choice {
        BackendChoice::Exactly(k) => k,
        BackendChoice::Auto => {
            let b = select(BackendChoice::Auto)?;
            if device == 0 || b.kind() == BackendKind::Host {
                return Ok(b);
            }
            b.kind()
        }
    };
    open_on(kind, device)
}
