//! [`NixlEngine`]: the [`TransferEngine`] over one or two [`NixlAgent`]s — posting a call's
//! spans as one NIXL write request, and polling the request and the receiver's notification.
//!
//! Separate from the agent in the parent: the agent is NIXL's object (registrations, metadata,
//! requests); this is the engine contract of `transfer::engine` built on it.

use super::ffi::{Handle, NOTIF_PREFIX};
use super::{agent_name, NixlAgent, NixlMem, NixlOptions};
use crate::transfer::engine::{
    EngineError, MemRegion, RegionId, Registry, Side, Span, TransferEngine, TransferTicket,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The notification a ticket's request carries: `v4pool:<initiator>:<ticket>`.
pub fn ticket_notification(initiator: &str, ticket: TransferTicket) -> Vec<u8> {
    format!("{NOTIF_PREFIX}{initiator}:{}", ticket.0).into_bytes()
}

struct Pending {
    req: Handle,
    /// The initiator's status said done.
    done: bool,
    /// The receiving agent saw the notification (pair mode), or nobody here waits for it.
    delivered: bool,
}

/// A [`TransferEngine`] over NIXL. See the module docs.
pub struct NixlEngine {
    local: NixlAgent,
    /// The receiving agent (pair mode), or `None` when the receiver is another process.
    remote: Option<NixlAgent>,
    peer: Option<String>,
    mems: (NixlMem, NixlMem),
    registry: Registry,
    /// Remote registrations changed since the peer's metadata was last loaded.
    remote_stale: bool,
    /// A remote region was deregistered since then: the peer's metadata is reloaded from
    /// scratch, because NIXL merges a reload into what it holds and would keep the dropped
    /// region's descriptor (and its remote key), which a later region at an overlapping
    /// address could be matched against.
    remote_dropped: bool,
    next_ticket: u64,
    pending: BTreeMap<u64, Pending>,
    /// Requests given up on (a wait that timed out) that NIXL could not cancel: they may
    /// still write, so no region is deregistered while any is here.
    stuck: Vec<Handle>,
    wait_timeout: Duration,
}

// SAFETY: see `NixlAgent`; the request handles are owned and used through `&mut self`.
unsafe impl Send for NixlEngine {}

impl std::fmt::Debug for NixlEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlEngine")
            .field("local", &self.local)
            .field("remote", &self.remote)
            .field("mems", &self.mems)
            .finish()
    }
}

impl NixlEngine {
    /// Two agents in this process: `Local` regions on the first (the initiator, of memory
    /// kind `local`), `Remote` regions on the second (of kind `remote`).
    pub fn pair(local: NixlMem, remote: NixlMem, options: &NixlOptions) -> Result<NixlEngine, EngineError> {
        let a = NixlAgent::new(Some(&agent_name("send")), options)?;
        let b = NixlAgent::new(Some(&agent_name("recv")), options)?;
        Ok(NixlEngine::build(a, Some(b), None, (local, remote), options))
    }

    /// The initiator end, `agent`, writing into a peer agent of another process whose
    /// metadata is `peer_md`. `Remote` registrations name the peer's memory (which the peer
    /// registered itself; reload its metadata with [`NixlEngine::reload_peer`] after it
    /// registers more). [`TransferEngine::exchange`] is refused: the handshake goes over the
    /// channel that carried the metadata.
    pub fn to_peer(
        mut agent: NixlAgent,
        peer_md: &[u8],
        mems: (NixlMem, NixlMem),
        options: &NixlOptions,
    ) -> Result<NixlEngine, EngineError> {
        let peer = agent.load_peer(peer_md)?;
        Ok(NixlEngine::build(agent, None, Some(peer), mems, options))
    }

    fn build(
        local: NixlAgent,
        remote: Option<NixlAgent>,
        peer: Option<String>,
        mems: (NixlMem, NixlMem),
        options: &NixlOptions,
    ) -> NixlEngine {
        NixlEngine {
            local,
            remote,
            peer,
            mems,
            registry: Registry::default(),
            remote_stale: false,
            remote_dropped: false,
            next_ticket: 0,
            pending: BTreeMap::new(),
            stuck: Vec::new(),
            wait_timeout: options.wait_timeout,
        }
    }

    /// The initiating agent's name.
    pub fn agent_name(&self) -> &str {
        self.local.name()
    }

    /// Load the peer's fresh metadata (peer mode).
    pub fn reload_peer(&mut self, md: &[u8]) -> Result<(), EngineError> {
        self.peer = Some(self.local.load_peer(md)?);
        Ok(())
    }

    /// Requests posted and not yet completed (each holds NIXL resources).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Load the receiving agent's current metadata into the initiator (pair mode).
    fn refresh_remote(&mut self) -> Result<(), EngineError> {
        if let Some(b) = &self.remote {
            let md = b.metadata()?;
            if self.remote_dropped {
                if let Some(p) = self.peer.take() {
                    self.local.forget_peer(&p)?;
                }
            }
            self.peer = Some(self.local.load_peer(&md)?);
        }
        self.remote_stale = false;
        self.remote_dropped = false;
        Ok(())
    }

    /// Forget ticket `t`'s request; one NIXL cannot cancel is kept in `stuck`.
    fn finish(&mut self, t: u64) {
        if let Some(p) = self.pending.remove(&t) {
            // SAFETY: created by the local agent; forgotten here unless it stays stuck.
            if !unsafe { self.local.drop_request(p.req) } {
                self.stuck.push(p.req);
            }
        }
    }

    /// Try again to release requests NIXL could not cancel.
    fn release_stuck(&mut self) {
        let mut still = Vec::new();
        for req in std::mem::take(&mut self.stuck) {
            // SAFETY: created by the local agent, not released yet.
            if !unsafe { self.local.drop_request(req) } {
                still.push(req);
            }
        }
        self.stuck = still;
    }
}

impl TransferEngine for NixlEngine {
    fn name(&self) -> &'static str {
        "nixl"
    }

    unsafe fn register(&mut self, side: Side, region: MemRegion) -> Result<RegionId, EngineError> {
        match (side, self.remote.as_mut()) {
            // SAFETY: the caller's promise on the region, forwarded.
            (Side::Local, _) => unsafe { self.local.register(self.mems.0, region.addr, region.len)? },
            (Side::Remote, Some(b)) => {
                // SAFETY: as above.
                unsafe { b.register(self.mems.1, region.addr, region.len)? };
                self.remote_stale = true;
            }
            // The peer registered its own memory; NIXL checks every remote descriptor
            // against the peer's loaded metadata when the request is created.
            (Side::Remote, None) => {}
        }
        Ok(self.registry.insert(side, region))
    }

    fn deregister(&mut self, id: RegionId) -> Result<(), EngineError> {
        let (side, r) = self.registry.get(id)?;
        self.release_stuck();
        if !self.pending.is_empty() || !self.stuck.is_empty() {
            return Err(EngineError::Nixl {
                call: "deregister_mem",
                message: format!(
                    "{} transfers in flight, {} that could not be cancelled",
                    self.pending.len(),
                    self.stuck.len()
                ),
            });
        }
        match (side, self.remote.as_mut()) {
            (Side::Local, _) => self.local.deregister(self.mems.0, r.addr, r.len)?,
            (Side::Remote, Some(b)) => {
                b.deregister(self.mems.1, r.addr, r.len)?;
                self.remote_stale = true;
                self.remote_dropped = true;
            }
            (Side::Remote, None) => {}
        }
        self.registry.remove(id)
    }

    fn exchange(&mut self, local_msg: &[u8], remote_msg: &[u8]) -> Result<(Vec<u8>, Vec<u8>), EngineError> {
        let Some(b) = self.remote.as_mut() else {
            return Err(EngineError::Nixl {
                call: "exchange",
                message:
                    "an engine to another process's agent carries no handshake: send it over the channel \
                          that carried the peer's metadata"
                        .into(),
            });
        };
        // Each agent learns the other (name, connection info) before any KV byte moves.
        let md_a = self.local.metadata()?;
        b.load_peer(&md_a)?;
        self.refresh_remote()?;
        Ok((local_msg.to_vec(), remote_msg.to_vec()))
    }

    fn post(&mut self, spans: &[Span]) -> Result<TransferTicket, EngineError> {
        let resolved: Vec<(u64, u64, u64)> =
            self.registry.resolve(spans)?.into_iter().filter(|s| s.2 > 0).collect();
        let t = TransferTicket(self.next_ticket);
        if resolved.is_empty() {
            self.next_ticket += 1;
            return Ok(t);
        }
        if self.remote_stale || self.peer.is_none() {
            self.refresh_remote()?;
        }
        let peer = self.peer.clone().ok_or_else(|| EngineError::Nixl {
            call: "create_xfer_req",
            message: "no peer metadata loaded (call exchange first)".into(),
        })?;
        let notif = ticket_notification(self.local.name(), t);
        // SAFETY: every range lies in a registered region (checked by `resolve`) that the
        // registrant promised stays live; deregistration waits for no request in flight.
        let req = unsafe { self.local.write(&peer, self.mems, &resolved, &notif)? };
        self.next_ticket += 1;
        self.pending.insert(t.0, Pending { req, done: false, delivered: self.remote.is_none() });
        Ok(t)
    }

    fn poll(&mut self, ticket: TransferTicket) -> Result<bool, EngineError> {
        if ticket.0 >= self.next_ticket {
            return Err(EngineError::UnknownTicket(ticket));
        }
        // Progress for every request in flight, and the receiver's notifications.
        let keys: Vec<u64> = self.pending.keys().copied().collect();
        for k in keys {
            let req = self.pending[&k].req;
            match self.local.status(req) {
                Ok(done) => {
                    if let Some(p) = self.pending.get_mut(&k) {
                        p.done |= done;
                    }
                }
                Err(e) => {
                    self.finish(k);
                    if k == ticket.0 {
                        return Err(e);
                    }
                }
            }
        }
        if let Some(b) = self.remote.as_mut() {
            let me = self.local.name().to_string();
            for (from, msg) in b.notifications()? {
                if from != me {
                    continue;
                }
                let t = std::str::from_utf8(&msg)
                    .ok()
                    .and_then(|s| s.strip_prefix(NOTIF_PREFIX))
                    .and_then(|s| s.rsplit_once(':'))
                    .and_then(|(_, t)| t.parse::<u64>().ok());
                if let Some(p) = t.and_then(|t| self.pending.get_mut(&t)) {
                    p.delivered = true;
                }
            }
        }
        let complete: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.done && p.delivered).map(|(&k, _)| k).collect();
        for k in complete {
            self.finish(k);
        }
        // Completed (now or earlier) tickets are no longer pending.
        Ok(!self.pending.contains_key(&ticket.0))
    }

    fn wait(&mut self, ticket: TransferTicket) -> Result<(), EngineError> {
        let start = Instant::now();
        while !self.poll(ticket)? {
            if start.elapsed() > self.wait_timeout {
                self.finish(ticket.0);
                let cancelled = if self.stuck.is_empty() {
                    "cancelled"
                } else {
                    "NOT cancelled: it may still write, and the engine keeps every region registered"
                };
                return Err(EngineError::Nixl {
                    call: "wait",
                    message: format!(
                        "transfer not complete after {:?} (peer gone?); {cancelled}",
                        self.wait_timeout
                    ),
                });
            }
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl Drop for NixlEngine {
    fn drop(&mut self) {
        // Let requests in flight finish (bounded), then release what is left before the
        // agents deregister their memory.
        let deadline = Instant::now() + Duration::from_secs(5).min(self.wait_timeout);
        while let Some(&k) = self.pending.keys().next() {
            if Instant::now() > deadline || self.poll(TransferTicket(k)).is_err() {
                self.finish(k);
            }
        }
        // What NIXL still cannot cancel ends with the agent (its destruction tears down the
        // UCX worker and every request on it).
        self.release_stuck();
        // The agents deregister their memory when they drop (receiver first: fields in order).
        if let Some(b) = self.remote.take() {
            drop(b);
        }
    }
}
