//! `PoolSpec`: what a pool is built from, checked again in full by `Pool::new`.

use super::PoolError;
use crate::arena::ArenaLayout;
use crate::checkpoint::LayoutId;
use crate::geometry::UnifiedPoolGeometry;
use crate::sizing::{IndexerDtype, IndexerPart, KvSpec};

/// What the pool is built from: a geometry at a fixed plane capacity (its split is the
/// initial one), the plane widths, the arena, and the indexer cache's shape.
///
/// The fields are public to read; [`Pool::new`](super::Pool::new) checks them all against each other again
/// ([`PoolSpec::validate`]), so a spec edited into inconsistency is refused, never carved.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    /// The row space at its fixed plane capacity and initial split.
    pub geometry: UnifiedPoolGeometry,
    /// Row bytes of each plane (the row format's, where the spec has one: [`PoolSpec::kv_spec`]).
    pub plane_widths: Vec<u64>,
    /// The compressor-state fields and where they sit in a slot.
    pub arena: ArenaLayout,
    /// The CSA indexer cache's format (`None`: no indexer cache).
    pub indexer: Option<IndexerDtype>,
    /// Global ids of the layers owning index keys, the indexer cache's layer order
    /// ([`UnifiedPoolGeometry::index_key_layers`]): V4's CSA layers, V4.1's KV sources.
    pub csa_layers: Vec<usize>,
    /// The §6 layout id of the plan the spec came from, with the spec's fingerprint then: a
    /// pool only reports the plan's id while the spec still is what the plan made.
    plan_layout: Option<(LayoutId, String)>,
    /// What the rows are ([`KvSpec`]): the plan's, or one given to a spec from parts
    /// ([`PoolSpec::with_kv_spec`]); a spec from parts without one has byte planes only (no
    /// row writer, gather or attention path).
    kv_spec: Option<KvSpec>,
}

impl PoolSpec {
    /// A spec from its parts, checked ([`PoolSpec::validate`]). Its images carry a layout id
    /// derived from every part that gives image bytes their meaning
    /// ([`PoolSpec::layout_id`]); use [`PoolSpec::from_plan`] for the §6 id of a model.
    pub fn new(
        geometry: UnifiedPoolGeometry,
        plane_widths: Vec<u64>,
        arena: ArenaLayout,
        indexer: Option<IndexerDtype>,
        csa_layers: Vec<usize>,
    ) -> Result<PoolSpec, PoolError> {
        let spec =
            PoolSpec { geometry, plane_widths, arena, indexer, csa_layers, plan_layout: None, kv_spec: None };
        spec.validate()?;
        Ok(spec)
    }

    /// The checkpoint layout of pools of this spec: what one checkpoint's units hold (the
    /// manager's, and the shared tier's count of a checkpoint entry's units).
    pub fn checkpoint_layout(
        &self,
    ) -> Result<crate::checkpoint::CheckpointLayout, crate::checkpoint::CheckpointError> {
        let layers: &[usize] = if self.indexer.is_some() { &self.csa_layers } else { &[] };
        let planes: Vec<crate::format::PlaneFormat> =
            (0..self.plane_widths.len()).filter_map(|p| self.plane_format(p)).collect();
        crate::checkpoint::CheckpointLayout::for_planes(
            &self.arena,
            &self.geometry,
            layers,
            self.indexer.unwrap_or(IndexerDtype::Fp8),
            &planes,
        )
    }

    /// The spec of a sized plan: its carve, its arena, its indexer shape. The pool sizes
    /// its indexer cache for every block the plane can hold, so the plan must allow the
    /// boundary down to zero slots (`min_slots = 0`, the default).
    pub fn from_plan(plan: &crate::sizing::Plan) -> Result<PoolSpec, PoolError> {
        if plan.min_slots != 0 {
            return Err(PoolError::MinSlots(plan.min_slots));
        }
        let mut spec = Self::from_layout(&plan.layout, plan.geometry.clone())?;
        spec.kv_spec = Some(plan.kv_spec()?);
        Ok(spec)
    }

    /// This spec with its rows described by `kv` (a spec from parts: tests, engines carving
    /// their own geometry): refused unless the planes are `kv`'s row format's and the
    /// geometry packs compressed rows as `kv` does.
    pub fn with_kv_spec(mut self, kv: KvSpec) -> Result<PoolSpec, PoolError> {
        self.kv_spec = Some(kv);
        self.validate()?;
        Ok(self)
    }

    /// The spec of a priced layout carved to `geometry` (e.g. [`PoolLayout::carve`]): the
    /// layout's arena, widths and indexer, and its §6 layout id for the pool's images.
    ///
    /// [`PoolLayout::carve`]: crate::sizing::PoolLayout::carve
    pub fn from_layout(
        layout: &crate::sizing::PoolLayout,
        geometry: UnifiedPoolGeometry,
    ) -> Result<PoolSpec, PoolError> {
        let mut spec = PoolSpec {
            geometry,
            plane_widths: layout.widths().to_vec(),
            arena: layout.arena.clone(),
            indexer: Some(layout.indexer),
            csa_layers: layout.model.indexer_layers(),
            plan_layout: None,
            kv_spec: Some(layout.kv_spec(None)?),
        };
        spec.validate()?;
        let id = LayoutId::for_layout(layout)?;
        spec.plan_layout = Some((id, spec.fingerprint()));
        Ok(spec)
    }

    /// Check every part against the others: the geometry is what its own inputs build
    /// (no field edited after the carve) with positions numbered from 0, the arena was
    /// planned for these plane widths and has the geometry's arena rows and slot alignment,
    /// the CSA layers are the geometry's ratio-4 layers, and the plan's layout id (if any)
    /// still describes the spec.
    pub fn validate(&self) -> Result<(), PoolError> {
        let g = &self.geometry;
        if g.slot_origin != 0 {
            return Err(PoolError::SlotOrigin(g.slot_origin));
        }
        if UnifiedPoolGeometry::new(g.spec())? != *g {
            return Err(PoolError::InconsistentSpec {
                what: "geometry (a field differs from what its inputs build)",
            });
        }
        if self.plane_widths.is_empty() || self.plane_widths.contains(&0) {
            return Err(PoolError::InconsistentSpec { what: "plane_widths (empty, or a zero width)" });
        }
        if let Some(p) = g.packed_rows {
            // Compressed rows packed at their own width live in one plane of `p.plane`-B rows.
            if self.plane_widths.len() != 1 || i64::try_from(self.plane_widths[0]).ok() != Some(p.plane) {
                return Err(PoolError::InconsistentSpec {
                    what: "plane_widths (packed compressed rows need one plane of the packing's row width)",
                });
            }
        }
        if self.arena.widths() != self.plane_widths {
            return Err(PoolError::InconsistentSpec {
                what: "plane_widths (the arena was planned for others)",
            });
        }
        if self.arena.arena_rows() != g.arena_rows {
            return Err(PoolError::ArenaMismatch { arena: self.arena.arena_rows(), geometry: g.arena_rows });
        }
        if self.arena.slot_align_rows() != g.slot_align_rows {
            return Err(PoolError::InconsistentSpec { what: "slot_align_rows (arena and geometry differ)" });
        }
        if g.index_key_layers() != self.csa_layers {
            return Err(PoolError::InconsistentSpec {
                what:
                    "csa_layers (not the geometry's index-key layers: V4's ratio-4 layers, V4.1's KV sources)",
            });
        }
        if let Some(kv) = &self.kv_spec {
            if !kv.row_format().planes.iter().map(|p| p.row_bytes()).eq(self.plane_widths.iter().copied()) {
                return Err(PoolError::InconsistentSpec {
                    what: "plane_widths (not the row format's planes)",
                });
            }
            if kv.packed() != g.packed_rows {
                return Err(PoolError::InconsistentSpec {
                    what: "packed_rows (the geometry packs compressed rows otherwise than the row format)",
                });
            }
        }
        if let Some((_, fp)) = &self.plan_layout {
            if *fp != self.fingerprint() {
                return Err(PoolError::InconsistentSpec { what: "a part edited after from_plan" });
            }
        }
        Ok(())
    }

    /// What the pool's rows are (`None` for a spec from parts given none).
    pub fn kv_spec(&self) -> Option<&KvSpec> {
        self.kv_spec.as_ref()
    }

    /// The row format: what every byte of a plane row means (`None` without a [`KvSpec`]).
    pub fn row_format(&self) -> Option<&'static crate::format::RowFormat> {
        self.kv_spec.as_ref().map(KvSpec::row_format)
    }

    /// Plane `plane`'s row layout (regions, paging): the row format's plane, or for a spec from
    /// parts without one the plane of its width ([`crate::format::plane_of_width`]). The one
    /// answer to "how are this plane's rows paged" that page views and checkpoint ranges read:
    /// two formats share the 584-B width at different pages.
    pub fn plane_format(&self, plane: usize) -> Option<crate::format::PlaneFormat> {
        let w = *self.plane_widths.get(plane)?;
        Some(match self.row_format() {
            Some(f) => *f.planes.get(plane)?,
            None => crate::format::plane_of_width(w),
        })
    }

    /// Rows of the page an attention kernel reads the planes in (FlashMLA's `k_cache =
    /// [pages, page_rows, 1, row_bytes]`): the row format's `kernel_page_rows`; for a spec from
    /// parts without one, FlashMLA's V4 format's (64).
    pub fn kernel_page_rows(&self) -> i64 {
        let f = self.row_format().unwrap_or(crate::format::RowFormatId::FlashMlaV4.format());
        f.kernel_page_rows as i64
    }

    /// The one element type every byte of plane `plane`'s rows holds, read from the row format:
    /// `Some(e)` where the plane is values of `e` alone (ATOM fp8's RoPE plane, the bf16 plane:
    /// bf16), `None` where encodings or scales share it (the fp8 NoPE plane, FlashMLA's rows:
    /// bytes) or the spec has no format. What a binding exports a plane's views as.
    pub fn plane_elem(&self, plane: usize) -> Option<crate::format::Elem> {
        let f = self.row_format()?;
        let row_bits = f.planes.get(plane)?.row_bytes() * 8;
        if f.segments.iter().any(|s| s.scale.is_some_and(|c| c.place.plane == plane)) {
            return None;
        }
        let mut elem = None;
        let mut bits = 0u64;
        for s in f.segments.iter().filter(|s| s.data.plane == plane) {
            if elem.is_some_and(|e| e != s.elem) {
                return None;
            }
            elem = Some(s.elem);
            bits += s.count as u64 * s.elem.bits() as u64;
        }
        elem.filter(|_| bits == row_bits)
    }

    /// The indexer cache's layers per indexer pool ([`IndexerDtype::layer_parts`]); empty
    /// without an indexer cache.
    pub fn indexer_parts(&self) -> Result<Vec<Vec<IndexerPart>>, PoolError> {
        match self.indexer.filter(|_| !self.csa_layers.is_empty()) {
            Some(ix) => Ok(ix.layer_parts(&self.geometry, &self.csa_layers)?),
            None => Ok(Vec::new()),
        }
    }

    /// The layout id images of this spec's pools carry: the plan's §6 id for a spec from
    /// [`PoolSpec::from_plan`], else one built from every part that gives image bytes their
    /// meaning (ratios in order, ring, block size, rows, widths, arena fields, indexer).
    pub fn layout_id(&self) -> LayoutId {
        match &self.plan_layout {
            Some((id, _)) => id.clone(),
            None => LayoutId::new(self.fingerprint()),
        }
    }

    /// Everything that decides what an image's bytes mean, on one line.
    fn fingerprint(&self) -> String {
        let g = &self.geometry;
        let join = |v: &[String]| v.join(",");
        let fields: Vec<String> = self
            .arena
            .fields()
            .iter()
            .map(|f| {
                let shape: Vec<String> = f.shape.iter().map(u64::to_string).collect();
                format!(
                    "{}[{}x{}]{:?}/{:?}/{}/{}",
                    f.name,
                    f.layers,
                    shape.join("x"),
                    f.dtype,
                    f.fill,
                    if f.carried { "carried" } else { "nocopy" },
                    f.align
                )
            })
            .collect();
        let id = format!(
            "v4pool-spec:ratios={}:block={}:ring={}:arena_rows={}:entry_rows={}:slot_rows={}:widths={}\
             :fields={}:indexer={}:csa={}",
            join(&g.ratios.iter().map(i32::to_string).collect::<Vec<_>>()),
            g.block_size,
            g.ring_slots,
            g.arena_rows,
            g.entry_rows,
            g.slot_rows,
            join(&self.plane_widths.iter().map(u64::to_string).collect::<Vec<_>>()),
            fields.join(";"),
            self.indexer.map_or("none", |ix| ix.name()),
            join(&self.csa_layers.iter().map(usize::to_string).collect::<Vec<_>>()),
        );
        // Shared compressors change every compressed address; V4's id stays as it was.
        let id = match &g.kv_sources {
            None => id,
            Some(src) => format!(
                "{id}:kv_sources={}:form={:?}",
                join(&src.iter().map(usize::to_string).collect::<Vec<_>>()),
                g.form
            ),
        };
        match g.packed_rows {
            None => id,
            Some(p) => format!("{id}:packed={}/{}", p.compressed, p.plane),
        }
    }
}
