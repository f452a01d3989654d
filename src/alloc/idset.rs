//! A set of ids with O(log64 n) insert, remove and minimum: a bitset with a summary level per
//! 64× fan-in (bit `i` of level `k+1` says word `i` of level `k` is non-zero).
//!
//! This is the allocators' vacant container: "lowest vacant id first" is exactly `min`, and
//! membership is exact, so vacant ids need no lazy deletion. Five levels cover 2^30 ids; a
//! pop or push touches one word per level.

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct IdSet {
    /// `levels[0]` holds one bit per id; the last level is a single word.
    levels: Vec<Vec<u64>>,
    len: u32,
}

impl IdSet {
    /// Make room for ids `0..capacity` (never shrinks; members are kept).
    pub(crate) fn grow_to(&mut self, capacity: usize) {
        let words = capacity.div_ceil(64).max(1);
        if self.levels.first().is_some_and(|l| l.len() >= words) {
            return;
        }
        let mut leaf = self.levels.first().cloned().unwrap_or_default();
        leaf.resize(words, 0);
        self.levels = vec![leaf];
        // Rebuild the summaries over the larger leaf level.
        while self.levels.last().map_or(0, Vec::len) > 1 {
            let below = self.levels.last().map_or(&[][..], |l| &l[..]);
            let mut up = vec![0u64; below.len().div_ceil(64)];
            for (i, &w) in below.iter().enumerate() {
                if w != 0 {
                    up[i / 64] |= 1 << (i % 64);
                }
            }
            self.levels.push(up);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    #[inline]
    pub(crate) fn contains(&self, id: u32) -> bool {
        let i = id as usize;
        self.levels.first().and_then(|l| l.get(i / 64)).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Add `id`; returns whether it was absent. Grows if `id` is beyond the capacity.
    #[inline]
    pub(crate) fn insert(&mut self, id: u32) -> bool {
        let mut i = id as usize;
        if self.levels.first().is_none_or(|l| i / 64 >= l.len()) {
            self.grow_to(i + 1);
        }
        let leaf = &mut self.levels[0][i / 64];
        let was = *leaf;
        if was & (1 << (i % 64)) != 0 {
            return false;
        }
        *leaf |= 1 << (i % 64);
        self.len += 1;
        // A word going from empty to non-empty sets its bit one level up, and so on.
        if was == 0 {
            for level in &mut self.levels[1..] {
                i /= 64;
                let w = &mut level[i / 64];
                let was = *w;
                *w |= 1 << (i % 64);
                if was != 0 {
                    break;
                }
            }
        }
        true
    }

    /// Remove `id`; returns whether it was present.
    #[inline]
    pub(crate) fn remove(&mut self, id: u32) -> bool {
        if !self.contains(id) {
            return false;
        }
        let mut i = id as usize;
        for level in &mut self.levels {
            let w = &mut level[i / 64];
            *w &= !(1 << (i % 64));
            if *w != 0 {
                break;
            }
            i /= 64;
        }
        self.len -= 1;
        true
    }

    /// Smallest member.
    #[inline]
    pub(crate) fn min(&self) -> Option<u32> {
        let top = self.levels.last()?;
        if top[0] == 0 {
            return None;
        }
        let mut i = 0usize;
        for level in self.levels.iter().rev() {
            i = i * 64 + level[i].trailing_zeros() as usize;
        }
        Some(i as u32)
    }

    /// Remove everything (capacity kept).
    #[cfg(test)]
    pub(crate) fn clear(&mut self) {
        for level in &mut self.levels {
            level.iter_mut().for_each(|w| *w = 0);
        }
        self.len = 0;
    }

    /// Members in ascending order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let leaf = self.levels.first().map_or(&[][..], |l| &l[..]);
        leaf.iter().enumerate().flat_map(|(wi, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros();
                w &= w - 1;
                Some(wi as u32 * 64 + b)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::IdSet;
    use std::collections::BTreeSet;

    #[test]
    fn matches_a_btreeset_across_levels() {
        // Ids spread over three levels (64^2 = 4096 < 300_000), with a deterministic walk.
        let mut s = IdSet::default();
        let mut m = BTreeSet::new();
        let mut rng = crate::rng::Rng::new(0x1234_5678_9ABC_DEF1);
        // Miri interprets every step: a shorter walk still crosses all three levels.
        let steps = if cfg!(miri) { 3_000 } else { 200_000u32 };
        for step in 0..steps {
            let id = rng.below(300_000) as u32;
            if step % 3 == 0 {
                assert_eq!(s.remove(id), m.remove(&id));
            } else if step % 7 == 0 {
                let lo = s.min();
                assert_eq!(lo, m.first().copied());
                if let Some(lo) = lo {
                    assert!(s.remove(lo) && m.remove(&lo));
                }
            } else {
                assert_eq!(s.insert(id), m.insert(id));
            }
            assert_eq!(s.len() as usize, m.len());
        }
        assert_eq!(s.min(), m.first().copied());
        assert!(s.iter().eq(m.iter().copied()));
        s.clear();
        assert_eq!((s.min(), s.len(), s.iter().count()), (None, 0, 0));
    }

    #[test]
    fn growing_keeps_members() {
        let mut s = IdSet::default();
        assert_eq!(s.min(), None);
        for id in [5, 63, 64, 4095] {
            s.insert(id);
        }
        s.grow_to(1 << 20);
        assert!(s.insert(300_000));
        assert!(s.iter().eq([5, 63, 64, 4095, 300_000]));
        assert!(s.remove(5) && s.remove(63) && s.remove(64));
        assert_eq!(s.min(), Some(4095));
        assert!(!s.contains(5) && s.contains(300_000));
    }
}
