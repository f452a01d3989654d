//! A min-heap of ids with lazy deletion and at most one physical entry per id.
//!
//! Removing an id from the middle of a heap is O(n); the allocators instead leave the entry in
//! place and skip it when it surfaces ("stale"). The `queued` flag keeps one entry per id, so a
//! block allocated and freed over and over without passing through the heap cannot make it
//! grow: the heap never holds more entries than there are ids.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[derive(Clone, Debug, Default)]
pub(crate) struct LazyMinHeap {
    heap: BinaryHeap<Reverse<u32>>,
    /// `queued[id]`: an entry for `id` is physically in `heap` (valid or stale).
    queued: Vec<bool>,
}

impl LazyMinHeap {
    /// Make room for ids `0..len` so pushes never allocate.
    pub(crate) fn grow_to(&mut self, len: usize) {
        if self.queued.len() < len {
            self.queued.resize(len, false);
        }
        let want = len.saturating_sub(self.heap.len());
        self.heap.reserve(want);
    }

    /// Queue `id` unless an entry for it is already in the heap (that entry becomes valid again
    /// by the caller's predicate, and its place in a min-heap depends on the id alone).
    #[inline]
    pub(crate) fn push(&mut self, id: u32) {
        let i = id as usize;
        if i >= self.queued.len() {
            self.grow_to(i + 1);
        }
        if !self.queued[i] {
            self.queued[i] = true;
            self.heap.push(Reverse(id));
        }
    }

    /// Lowest id for which `valid` holds, removed; stale entries on the way are dropped.
    #[inline]
    pub(crate) fn pop_valid(&mut self, valid: impl Fn(u32) -> bool) -> Option<u32> {
        while let Some(Reverse(id)) = self.heap.pop() {
            self.queued[id as usize] = false;
            if valid(id) {
                return Some(id);
            }
        }
        None
    }

    /// Lowest id for which `valid` holds, left in place; stale entries above it are dropped
    /// (that changes no observable state: they were never anyone's).
    pub(crate) fn peek_valid(&mut self, valid: impl Fn(u32) -> bool) -> Option<u32> {
        while let Some(&Reverse(id)) = self.heap.peek() {
            if valid(id) {
                return Some(id);
            }
            self.heap.pop();
            self.queued[id as usize] = false;
        }
        None
    }

    /// Replace the contents with exactly `ids`.
    pub(crate) fn rebuild(&mut self, ids: impl Iterator<Item = u32>) {
        self.heap.clear();
        self.queued.iter_mut().for_each(|q| *q = false);
        for id in ids {
            self.push(id);
        }
    }
}
