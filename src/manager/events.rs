//! What the manager reports to a router (issue 35): the blocks it holds, per tier, as KV
//! events — `Stored` when a block becomes resident in a tier, `Removed` when it leaves one —
//! in the vocabulary of vLLM's `BlockStored` / `BlockRemoved` (`medium`: `GPU` for the pool,
//! `CPU` for the host tier, `STORAGE` for the shared tier). The wire format lives in
//! `crate::events`; here are only the facts, collected while the manager works and taken by
//! [`KvManager::drain_events`] (once per step: the log is not bounded otherwise).
//!
//! A router matches prompts by recomputing block keys from tokens, so `Stored` carries each
//! block's tokens and its parent's hash when the engine told the manager a request's tokens
//! ([`KvManager::record_tokens`]); without them the events carry hashes only. The manager
//! keeps a block's parent and tokens while the block is in HBM or the host tier (so a spill's
//! event can name them), and forgets them when it leaves both.

use super::{BlockHash, KvManager, RequestId};
use std::collections::HashMap;

/// Where a block is resident, as KV events name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The pool (HBM on a GPU backend).
    Gpu,
    /// The host tier.
    Cpu,
    /// The shared tier (files every engine mounts).
    Storage,
}

impl Medium {
    /// vLLM's spelling (`MEDIUM_GPU`, `MEDIUM_CPU`, `MEDIUM_STORAGE`).
    pub fn name(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }
}

/// One change in what a tier holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// `hashes` (a chain: each the next block of the one before) became resident in
    /// `medium`; `parent` is the hash of the block before the first (`None`: the first
    /// block of a prompt, or not known); `tokens` are the blocks' tokens in order (empty
    /// when the engine recorded none).
    Stored {
        /// The blocks, in chain order.
        hashes: Vec<BlockHash>,
        /// The block before the first.
        parent: Option<BlockHash>,
        /// The blocks' tokens, `block_size` per block, or empty.
        tokens: Vec<u32>,
        /// Where they are now.
        medium: Medium,
    },
    /// `hashes` left `medium`.
    Removed {
        /// The blocks.
        hashes: Vec<BlockHash>,
        /// Where they were.
        medium: Medium,
    },
    /// Nothing is resident any more (the engine's cache reset).
    AllCleared,
}

/// A block's parent and tokens, kept while the block is resident in HBM or the host tier.
#[derive(Clone, Debug)]
struct BlockInfo {
    parent: Option<BlockHash>,
    tokens: Box<[u32]>,
}

/// The manager's event log (present only while events are on).
#[derive(Debug, Default)]
pub(super) struct EventLog {
    events: Vec<KvEvent>,
    info: HashMap<BlockHash, BlockInfo>,
}

impl EventLog {
    /// `h` became resident in `medium`: appended to the last event when that one is a
    /// `Stored` of the same medium whose chain `h` continues.
    pub(super) fn stored(&mut self, h: BlockHash, medium: Medium) {
        let info = self.info.get(&h);
        let parent = info.and_then(|i| i.parent);
        let tokens = info.map_or(&[][..], |i| &i.tokens);
        if let Some(KvEvent::Stored { hashes, tokens: all, medium: m, .. }) = self.events.last_mut() {
            // Tokens go with every block or none: a block without them starts a new event.
            let same_form = all.is_empty() == tokens.is_empty();
            if *m == medium && parent.is_some() && hashes.last().copied() == parent && same_form {
                hashes.push(h);
                all.extend_from_slice(tokens);
                return;
            }
        }
        self.events.push(KvEvent::Stored { hashes: vec![h], parent, tokens: tokens.to_vec(), medium });
    }

    /// `h` left `medium`: appended to the last event when that one is a `Removed` of the
    /// same medium.
    pub(super) fn removed(&mut self, h: BlockHash, medium: Medium) {
        if let Some(KvEvent::Removed { hashes, medium: m }) = self.events.last_mut() {
            if *m == medium {
                hashes.push(h);
                return;
            }
        }
        self.events.push(KvEvent::Removed { hashes: vec![h], medium });
    }

    /// Remember `h`'s parent and tokens (it entered the index).
    pub(super) fn learn(&mut self, h: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) {
        self.info.insert(h, BlockInfo { parent, tokens: tokens.into() });
    }

    /// Whether `h`'s parent and tokens are known.
    pub(super) fn knows(&self, h: BlockHash) -> bool {
        self.info.contains_key(&h)
    }

    /// Forget `h`'s parent and tokens (it is resident in neither HBM nor the host tier).
    pub(super) fn forget(&mut self, h: BlockHash) {
        self.info.remove(&h);
    }
}

impl KvManager {
    /// Start (or stop, dropping what is pending) recording KV events.
    pub fn enable_events(&mut self, on: bool) {
        self.events = on.then(EventLog::default);
    }

    /// Whether KV events are recorded.
    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// The events recorded since the last call, in order (empty when events are off).
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map_or_else(Vec::new, |l| std::mem::take(&mut l.events))
    }

    /// Record that the engine cleared its whole cache: an `AllCleared` event (what a router
    /// takes as "forget this engine's blocks").
    pub fn record_cleared(&mut self) {
        if let Some(l) = self.events.as_mut() {
            l.events.push(KvEvent::AllCleared);
        }
    }

    /// Append `tokens` to the tokens of request `id` as the engine knows them (prompt, then
    /// what it generates), so `Stored` events carry each block's tokens. Only kept while
    /// events are on; a request's tokens go when it finishes.
    pub fn record_tokens(&mut self, id: RequestId, tokens: &[u32]) -> Result<(), super::ManagerError> {
        let on = self.events.is_some();
        let r = self.req_mut(id)?;
        if on {
            r.tokens.extend_from_slice(tokens);
        }
        Ok(())
    }

    /// Record `medium`'s stored event for `h` (nothing when events are off).
    pub(super) fn event_stored(&mut self, h: BlockHash, medium: Medium) {
        if let Some(l) = self.events.as_mut() {
            l.stored(h, medium);
        }
    }

    /// Record `medium`'s removed event for `h`; `gone`: `h` is resident in no local tier any
    /// more, so its parent and tokens are forgotten.
    pub(super) fn event_removed(&mut self, h: BlockHash, medium: Medium, gone: bool) {
        if let Some(l) = self.events.as_mut() {
            l.removed(h, medium);
            if gone {
                l.forget(h);
            }
        }
    }
}
