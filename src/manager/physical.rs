//! The manager's physical layer: the node table of cached and private blocks and checkpoint
//! records, with the one intrusive recency list (least recently used at `head`) that holds every
//! unreferenced cached block and every ready, unpinned checkpoint — what eviction may take —
//! and the [`EvictionPolicy`] that picks from it. The request layer (`request.rs`) and the store,
//! boundary and tier code (`mod.rs`, `tier.rs`) work on these; nothing here knows requests.

use super::{BlockHash, LayoutId};
use crate::alloc::BlockHandle;

pub(super) const NIL: u32 = u32::MAX;

/// A cached or private block.
#[derive(Clone, Debug)]
pub(super) struct BlockNode {
    pub(super) handle: BlockHandle,
    /// `Some` once committed and in the index (private duplicates stay `None`).
    pub(super) hash: Option<BlockHash>,
    pub(super) refs: u32,
    /// The checkpoint record ending at this block, or NIL.
    pub(super) ckpt: u32,
}

/// A checkpoint record's lifecycle state (§6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CkptState {
    /// Its store copy is queued; invisible to lookups until `complete_inflight`.
    Copying,
    /// Visible; restores may read it.
    Ready,
    /// Its block left the index; units go back once no writer or pin needs them.
    Evicting,
}

#[derive(Clone, Debug)]
pub(super) struct CkptNode {
    pub(super) hash: BlockHash,
    /// The block node it ends at (NIL once unindexed).
    pub(super) block: u32,
    pub(super) units: Vec<BlockHandle>,
    pub(super) state: CkptState,
    pub(super) pins: u32,
    /// Whether a request may drop it when it stores its next rolling checkpoint.
    pub(super) rolling: bool,
    /// Admissions that restored it.
    pub(super) restores: u32,
    /// Whether its chain has gone past it (a deeper checkpoint was stored through its block).
    pub(super) interior: bool,
    /// A proven reuse point, never demoted as superseded: restored after its chain had gone
    /// past it (a request diverged inside its span: a shared prefix's end, a branch), or
    /// restored twice. A single restore of a chain's end is a continuation (the next turn, a
    /// resumption): once that request stores deeper on the chain this one serves only a
    /// request that diverges inside its span, like any superseded checkpoint.
    pub(super) proven: bool,
    /// Whether a deeper checkpoint of its chain exists and nothing has shown it to be a
    /// branch point: it saves prefill only for a request that diverges inside its span, which
    /// no request has done, for a whole slot image of bytes — less prefill per byte than any
    /// block of a live chain. Kept at the evicted-first end of the LRU and spilled to a tier
    /// only into free room, never pushing an entry out (`docs/simulate.md`, "Retention under
    /// pressure"); a restore clears it.
    pub(super) superseded: bool,
    /// On the coarse level of its chain: a prompt end, or every fourth permanent point
    /// (`ManagerConfig::checkpoint_every` × 4 blocks; `request.rs`, `COARSE_EVERY`). When its
    /// chain is released only a deeper coarse checkpoint demotes it (a fine one — between two
    /// coarse points, or rolling — is demoted by any deeper one), and a restore from a fine
    /// checkpoint above it counts as its own (`KvManager::credit_coarse`). Why: the finer points are extra reuse, paid for
    /// in room; were a fine point to demote the coarse one below it, or take the restores
    /// that prove it, losing that fine point under pressure would leave the chain with less
    /// than the coarse cadence alone keeps (docs/simulate.md).
    pub(super) coarse: bool,
    pub(super) layout: LayoutId,
}

impl CkptNode {
    /// Count one restore of it (`begin_restore`'s own, or one a finer checkpoint above it
    /// served: `credit_coarse`): restored after its chain went past it, while superseded, or
    /// twice, it is a proven reuse point, and no longer superseded.
    pub(super) fn count_restore(&mut self) {
        self.restores = self.restores.saturating_add(1);
        self.proven |= self.interior || self.superseded || self.restores >= 2;
        self.superseded = false;
    }
}

#[derive(Clone, Debug)]
pub(super) enum Node {
    Free,
    Block(BlockNode),
    Ckpt(CkptNode),
}

/// Who holds a pool block id (for boundary moves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    None,
    Block(u32),
    Unit(u32, u32),
}

/// Nodes (blocks and checkpoints) with an intrusive LRU list: `head` is evicted first.
#[derive(Default)]
pub(super) struct Nodes {
    pub(super) nodes: Vec<Node>,
    pub(super) prev: Vec<u32>,
    pub(super) next: Vec<u32>,
    pub(super) in_lru: Vec<bool>,
    pub(super) free: Vec<u32>,
    pub(super) head: u32,
    pub(super) tail: u32,
    /// Blocks the LRU would free if evicted whole (blocks + units of listed checkpoints).
    pub(super) lru_blocks: u64,
}

impl Nodes {
    pub(super) fn new() -> Nodes {
        Nodes { head: NIL, tail: NIL, ..Nodes::default() }
    }
    pub(super) fn insert(&mut self, node: Node) -> u32 {
        if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i
        } else {
            self.nodes.push(node);
            self.prev.push(NIL);
            self.next.push(NIL);
            self.in_lru.push(false);
            (self.nodes.len() - 1) as u32
        }
    }
    pub(super) fn remove(&mut self, i: u32) -> Node {
        self.unlink(i);
        self.free.push(i);
        std::mem::replace(&mut self.nodes[i as usize], Node::Free)
    }
    pub(super) fn block(&self, i: u32) -> &BlockNode {
        match &self.nodes[i as usize] {
            Node::Block(b) => b,
            _ => unreachable!("node {i} is not a block"),
        }
    }
    pub(super) fn block_mut(&mut self, i: u32) -> &mut BlockNode {
        match &mut self.nodes[i as usize] {
            Node::Block(b) => b,
            _ => unreachable!("node {i} is not a block"),
        }
    }
    pub(super) fn ckpt(&self, i: u32) -> &CkptNode {
        match &self.nodes[i as usize] {
            Node::Ckpt(c) => c,
            _ => unreachable!("node {i} is not a checkpoint"),
        }
    }
    pub(super) fn ckpt_mut(&mut self, i: u32) -> &mut CkptNode {
        match &mut self.nodes[i as usize] {
            Node::Ckpt(c) => c,
            _ => unreachable!("node {i} is not a checkpoint"),
        }
    }
    pub(super) fn weight(&self, i: u32) -> u64 {
        match &self.nodes[i as usize] {
            Node::Ckpt(c) => c.units.len() as u64,
            _ => 1,
        }
    }
    /// Append (or move) `i` to the most-recently-used end.
    pub(super) fn touch(&mut self, i: u32) {
        self.unlink(i);
        let iu = i as usize;
        self.prev[iu] = self.tail;
        self.next[iu] = NIL;
        if self.tail != NIL {
            self.next[self.tail as usize] = i;
        } else {
            self.head = i;
        }
        self.tail = i;
        self.in_lru[iu] = true;
        self.lru_blocks += self.weight(i);
    }
    /// Put `i` at the evicted-first end.
    pub(super) fn touch_front(&mut self, i: u32) {
        self.unlink(i);
        let iu = i as usize;
        self.next[iu] = self.head;
        self.prev[iu] = NIL;
        if self.head != NIL {
            self.prev[self.head as usize] = i;
        } else {
            self.tail = i;
        }
        self.head = i;
        self.in_lru[iu] = true;
        self.lru_blocks += self.weight(i);
    }
    pub(super) fn unlink(&mut self, i: u32) {
        let iu = i as usize;
        if !self.in_lru[iu] {
            return;
        }
        let (p, n) = (self.prev[iu], self.next[iu]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.in_lru[iu] = false;
        self.lru_blocks -= self.weight(i);
    }
}

/// A node of the manager's table, as an eviction policy sees it (opaque; valid until the next
/// call that changes the manager).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeId(pub(super) u32);

/// What an evictable node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CandidateKind {
    /// An unreferenced cached block (evicting it also drops the checkpoint ending at it).
    Block,
    /// A ready, unpinned checkpoint record.
    Checkpoint {
        /// Block units it holds (what evicting it frees).
        units: u64,
        /// Whether a restore has read it (proven or not: see the manager's retention rule).
        restored: bool,
    },
}

/// One evictable node, in recency order (least recently used first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The node.
    pub id: NodeId,
    /// Its kind.
    pub kind: CandidateKind,
    /// Its place in the recency list, 0 = least recently used.
    pub age_rank: u64,
}

/// Which evictable node goes next when the manager needs free block ids. The manager keeps
/// one recency list of everything evictable (unreferenced cached blocks, ready unpinned
/// checkpoints) and asks the policy for a victim among them, least recently used first; the
/// policy returns one of the candidates it was shown (anything else is refused with
/// `ManagerError::Config`). What eviction does to the victim (spill to the tier, unindex, free
/// the ids) is the manager's and the same for every policy. [`Lru`] is the default.
pub trait EvictionPolicy: Send + Sync + std::fmt::Debug {
    /// A short name for reports.
    fn name(&self) -> &'static str;
    /// The next victim among `candidates` (never empty when called).
    fn victim(&self, candidates: &mut dyn Iterator<Item = Candidate>) -> Option<NodeId>;
}

/// Least recently used first: the head of the recency list, O(1).
#[derive(Clone, Copy, Debug, Default)]
pub struct Lru;

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn victim(&self, candidates: &mut dyn Iterator<Item = Candidate>) -> Option<NodeId> {
        candidates.next().map(|c| c.id)
    }
}

impl Nodes {
    /// The evictable nodes, least recently used first.
    pub(super) fn candidates(&self) -> impl Iterator<Item = Candidate> + '_ {
        let mut at = self.head;
        let mut rank = 0u64;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let i = at;
            at = self.next[i as usize];
            let kind = match &self.nodes[i as usize] {
                Node::Ckpt(c) => {
                    CandidateKind::Checkpoint { units: c.units.len() as u64, restored: c.restores > 0 }
                }
                _ => CandidateKind::Block,
            };
            let c = Candidate { id: NodeId(i), kind, age_rank: rank };
            rank += 1;
            Some(c)
        })
    }

    /// Whether `id` is on the recency list (a candidate a policy may return).
    pub(super) fn is_candidate(&self, id: NodeId) -> bool {
        self.in_lru.get(id.0 as usize).copied().unwrap_or(false)
    }
}
