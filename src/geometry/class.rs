//! The three KV classes of a V4 pool as a type, so a class index or a ratio that names no
//! class cannot be expressed where a class is meant.

use super::{
    index_slots, GeometryError, UnifiedPoolGeometry, WindowParams, CSA_RATIO, DENSE_RATIO, HCA_RATIO,
};
use std::fmt;

/// A KV class's slot in the index buffers: dense, fine ("CSA"), coarse ("HCA").
///
/// The discriminant is the slot in the decode builder's `classes` array (the kernels'
/// `V4POOL_CLASS_*`), so `class as usize` indexes it. Which compress ratio fills a slot is
/// the geometry's data ([`UnifiedPoolGeometry::class_ratio`]): V4's 4 and 128
/// ([`Class::ratio`]), V4.1's 1 and 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// Sliding-window-only layers (compress ratio 0): a window, no compressed rows.
    Dense = 0,
    /// Compressed sparse attention (ratio 4): a window plus the indexer's top-k rows.
    Csa = 1,
    /// Heavily compressed attention (ratio 128): a window plus every compressed row.
    Hca = 2,
}

/// Index-buffer slots: dense and the two compressed slots (the builders' `classes` arrays,
/// the kernels' `V4POOL_CLASS_*`). The row space itself holds any number of classes; a
/// geometry with more than two compressed ones gets no index buffers (`index_slots`).
pub const NUM_SLOTS: usize = 3;

impl Class {
    /// Every class, in slot order.
    pub const ALL: [Class; NUM_SLOTS] = [Class::Dense, Class::Csa, Class::Hca];

    /// V4's compress ratio of the slot (0, 4, 128); a geometry's own is
    /// [`UnifiedPoolGeometry::class_ratio`].
    pub const fn ratio(self) -> i32 {
        match self {
            Class::Dense => DENSE_RATIO,
            Class::Csa => CSA_RATIO,
            Class::Hca => HCA_RATIO,
        }
    }

    /// The class kept at compress ratio `ratio`; any other value is
    /// [`GeometryError::NoSuchClass`] (the absent ratio −1 included: it names no class).
    pub fn from_ratio(ratio: i32) -> Result<Class, GeometryError> {
        Class::ALL.into_iter().find(|c| c.ratio() == ratio).ok_or(GeometryError::NoSuchClass { ratio })
    }

    /// The class's slot in per-class arrays (the decode builder's `classes`).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The class named `name` ([`Class::name`]'s spelling: `dense`, `csa`, `hca`); any other
    /// text names none.
    pub fn from_name(name: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Lower-case name, as reports and error messages spell it.
    pub const fn name(self) -> &'static str {
        match self {
            Class::Dense => "dense",
            Class::Csa => "csa",
            Class::Hca => "hca",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl TryFrom<i32> for Class {
    type Error = GeometryError;
    fn try_from(ratio: i32) -> Result<Class, GeometryError> {
        Class::from_ratio(ratio)
    }
}

impl UnifiedPoolGeometry {
    /// The compress ratio in `class`'s index-buffer slot ([`index_slots`]: the smaller
    /// compressed ratio fine, the larger coarse), `None` when the geometry has no such layers;
    /// a geometry with more than two compressed classes has no slots (an error).
    pub fn class_ratio(&self, class: Class) -> Result<Option<i32>, GeometryError> {
        let (fine, coarse) = index_slots(&self.ratios)?;
        let r = match class {
            Class::Dense => DENSE_RATIO,
            Class::Csa => fine,
            Class::Hca => coarse,
        };
        Ok(self.class(r).map(|_| r))
    }

    /// Whether the geometry has layers in `class`'s slot.
    pub fn has_class(&self, class: Class) -> bool {
        matches!(self.class_ratio(class), Ok(Some(_)))
    }

    /// The window parameters of `class` ([`UnifiedPoolGeometry::window_params`] by slot).
    pub fn class_window_params(&self, class: Class) -> Result<WindowParams, GeometryError> {
        let ratio = self.class_ratio(class)?.ok_or(GeometryError::NoSuchClass { ratio: class.ratio() })?;
        self.window_params(ratio)
    }

    /// The slot of `layer_id`'s class.
    pub fn layer_slot(&self, layer_id: usize) -> Result<Class, GeometryError> {
        let ratio = self.layer_class(layer_id)?.ratio;
        Class::ALL
            .into_iter()
            .find(|&c| matches!(self.class_ratio(c), Ok(Some(r)) if r == ratio))
            .ok_or(GeometryError::NoSuchClass { ratio })
    }

    /// Whether the coarse slot takes every committed compressed row, built class-wide from
    /// the block tables (V4's head fill). False with shared compressors (V4.1): every
    /// compressed layer is top-k selected, so both slots are filled per layer by the
    /// translate-pack.
    pub fn coarse_head_fill(&self) -> bool {
        self.kv_sources.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_round_trip_and_others_are_refused() {
        for c in Class::ALL {
            assert_eq!(Class::from_ratio(c.ratio()), Ok(c));
            assert_eq!(Class::ALL[c.index()], c);
        }
        for r in [-1, 1, 2, 3, 5, 64, 127, 129, i32::MIN, i32::MAX] {
            assert_eq!(Class::from_ratio(r), Err(GeometryError::NoSuchClass { ratio: r }));
        }
        assert_eq!(Class::Hca.to_string(), "hca");
    }
}
