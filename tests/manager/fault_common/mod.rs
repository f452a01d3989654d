//! Shared by the fault and interleaving tests: a host backend that fails the N-th call of
//! one kind after being armed, counts calls of every kind, and can run a hook before a
//! chosen call (another thread's move at the worst moment, made deterministic).
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use v4pool::backend::host::HostBackend;
use v4pool::backend::{
    Backend, BackendError, BackendKind, BackendResult, DeviceAllocation, HostAllocation, HostMem, Stream,
};
use v4pool::raw::index::{DevicePtr, Launch};

/// The kinds of backend call the wrapper counts and can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Alloc,
    Upload,
    Download,
    Copy,
    Fill,
    Launch,
    Synchronize,
    AllocHost,
    UploadHost,
    DownloadHost,
}

/// Every kind, in a fixed order (the sweep walks them).
pub const CALLS: [Call; 10] = [
    Call::Alloc,
    Call::Upload,
    Call::Download,
    Call::Copy,
    Call::Fill,
    Call::Launch,
    Call::Synchronize,
    Call::AllocHost,
    Call::UploadHost,
    Call::DownloadHost,
];

type Hook = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Plan {
    counts: [u64; 10],
    /// Fail the `n`-th call (from 1) of this kind since arming.
    fail: Option<(Call, u64)>,
    fired: bool,
    /// Run once before the `n`-th call of this kind.
    hook: Option<(Call, u64, Hook)>,
}

/// The host backend with one injected failure at a time (see the module docs).
#[derive(Debug)]
pub struct FaultBackend {
    pub host: HostBackend,
    plan: Mutex<Plan>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan").field("counts", &self.counts).field("fail", &self.fail).finish()
    }
}

impl FaultBackend {
    pub fn new() -> Arc<FaultBackend> {
        Arc::new(FaultBackend { host: HostBackend::new(), plan: Mutex::new(Plan::default()) })
    }

    /// Start counting from zero; fail the `n`-th call of `call` (none if `None`).
    pub fn arm(&self, fail: Option<(Call, u64)>) {
        let mut p = self.plan.lock().unwrap();
        p.counts = [0; 10];
        p.fail = fail;
        p.fired = false;
    }

    /// Stop failing; whether the armed failure happened.
    pub fn disarm(&self) -> bool {
        let mut p = self.plan.lock().unwrap();
        p.fail = None;
        p.fired
    }

    /// Calls of each kind since arming.
    pub fn counts(&self) -> [u64; 10] {
        self.plan.lock().unwrap().counts
    }

    /// Run `hook` once, just before the `n`-th call of `call` from now (counts restart).
    pub fn hook_before(&self, call: Call, n: u64, hook: impl FnOnce() + Send + 'static) {
        let mut p = self.plan.lock().unwrap();
        p.counts = [0; 10];
        p.hook = Some((call, n, Box::new(hook)));
    }

    /// Whether a hook is still waiting to run.
    pub fn hook_pending(&self) -> bool {
        self.plan.lock().unwrap().hook.is_some()
    }

    /// Count one call; the injected error if this is the one to fail.
    fn enter(&self, call: Call, name: &'static str) -> BackendResult<()> {
        let hook = {
            let mut p = self.plan.lock().unwrap();
            let i = CALLS.iter().position(|&c| c == call).unwrap();
            p.counts[i] += 1;
            let n = p.counts[i];
            if p.fail == Some((call, n)) {
                p.fired = true;
                return Err(BackendError::Driver {
                    backend: BackendKind::Host,
                    call: name,
                    message: format!("injected failure of call {n}"),
                });
            }
            match p.hook.take() {
                Some((c, k, h)) if c == call && k == n => Some(h),
                other => {
                    p.hook = other;
                    None
                }
            }
        };
        // Outside the plan's lock: the hook may call the backend itself.
        if let Some(h) = hook {
            h();
        }
        Ok(())
    }
}

// SAFETY: every call forwards to the host backend (which keeps the trait's promises) or
// fails before touching memory.
unsafe impl Backend for FaultBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }
    fn device_name(&self) -> String {
        "fault-injecting host".into()
    }
    fn alloc_zeroed(&self, bytes: u64) -> BackendResult<DeviceAllocation> {
        self.enter(Call::Alloc, "alloc_zeroed")?;
        self.host.alloc_zeroed(bytes)
    }
    unsafe fn free(&self, alloc: DeviceAllocation) {
        // SAFETY: forwarded contract.
        unsafe { self.host.free(alloc) }
    }
    unsafe fn upload(&self, dst: DevicePtr, src: &[u8], stream: Stream) -> BackendResult<()> {
        self.enter(Call::Upload, "upload")?;
        // SAFETY: forwarded contract.
        unsafe { self.host.upload(dst, src, stream) }
    }
    unsafe fn download(&self, dst: &mut [u8], src: DevicePtr, stream: Stream) -> BackendResult<()> {
        self.enter(Call::Download, "download")?;
        // SAFETY: forwarded contract.
        unsafe { self.host.download(dst, src, stream) }
    }
    unsafe fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64, stream: Stream) -> BackendResult<()> {
        self.enter(Call::Copy, "copy")?;
        // SAFETY: forwarded contract.
        unsafe { self.host.copy(dst, src, bytes, stream) }
    }
    unsafe fn fill_u32(&self, dst: DevicePtr, count: u64, value: u32, stream: Stream) -> BackendResult<()> {
        self.enter(Call::Fill, "fill_u32")?;
        // SAFETY: forwarded contract.
        unsafe { self.host.fill_u32(dst, count, value, stream) }
    }
    unsafe fn launch(&self, launch: &Launch, stream: Stream) -> BackendResult<()> {
        self.enter(Call::Launch, "launch")?;
        // SAFETY: forwarded contract.
        unsafe { self.host.launch(launch, stream) }
    }
    fn synchronize(&self, stream: Stream) -> BackendResult<()> {
        self.enter(Call::Synchronize, "synchronize")?;
        self.host.synchronize(stream)
    }
    unsafe fn adopt_external(&self, ptr: DevicePtr, bytes: u64) {
        // SAFETY: forwarded contract.
        unsafe { self.host.adopt_external(ptr, bytes) }
    }
    fn forget_external(&self, ptr: DevicePtr) {
        self.host.forget_external(ptr)
    }
    fn alloc_host(&self, bytes: u64) -> BackendResult<HostAllocation> {
        self.enter(Call::AllocHost, "alloc_host")?;
        self.host.alloc_host(bytes)
    }
    unsafe fn free_host(&self, alloc: HostAllocation) {
        // SAFETY: forwarded contract.
        unsafe { self.host.free_host(alloc) }
    }
    unsafe fn upload_host(&self, dst: DevicePtr, src: HostMem, stream: Stream) -> BackendResult<()> {
        self.enter(Call::UploadHost, "upload_host")?;
        // SAFETY: forwarded contract.
        unsafe { self.host.upload_host(dst, src, stream) }
    }
    unsafe fn download_host(&self, dst: HostMem, src: DevicePtr, stream: Stream) -> BackendResult<()> {
        self.enter(Call::DownloadHost, "download_host")?;
        // SAFETY: forwarded contract.
        unsafe { self.host.download_host(dst, src, stream) }
    }
}
