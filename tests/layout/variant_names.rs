//! `VariantName`: every error names its innermost variant (`variant_names!`, no `Debug` text read), the
//! device-failure flag follows the wrapped backend error, and the names the bindings parse
//! (classes, compressors, backends) live in the library.

use v4pool::backend::{self, BackendChoice, BackendError, BackendKind};
use v4pool::geometry::GeometryError;
use v4pool::pool::{DecodeError, PoolError, WriteBatchError};
use v4pool::raw::index::shape::LaunchError;
use v4pool::state::update::Compressor;
use v4pool::{Class, VariantName};

#[test]
fn variant_names_descend_through_wrappers() {
    let e = PoolError::Geometry(GeometryError::RingSlots { got: -1 });
    assert_eq!(e.variant_name(), "RingSlots");
    let d = PoolError::Decode(Box::new(DecodeError::NegativeTopk(-1)));
    assert_eq!(d.variant_name(), "NegativeTopk");
    let p = DecodeError::Pool(Box::new(PoolError::Poisoned));
    assert_eq!(p.variant_name(), "Poisoned");
    assert_eq!(PoolError::MinSlots(3).variant_name(), "MinSlots");
    // A tuple payload that is no error is no variant: the outer name stands (the `Debug`
    // reading named `Csa` here).
    assert_eq!(DecodeError::MissingClass(Class::Csa).variant_name(), "MissingClass");
    let b = PoolError::Backend(BackendError::UnknownBackendName { value: "x".into() });
    assert_eq!(b.variant_name(), "UnknownBackendName");
    // A struct variant listed `via_source` is named by its `source` field; the others by
    // their own name.
    let invalid =
        WriteBatchError::Invalid { index: 3, source: LaunchError::Negative { field: "rows", value: -1 } };
    assert_eq!(invalid.variant_name(), "Negative");
    assert_eq!(WriteBatchError::Count { got: 0, cap: 4 }.variant_name(), "Count");
}

#[test]
fn device_failures_are_the_backend_drivers() {
    let oom = BackendError::OutOfMemory { backend: BackendKind::Host, bytes: 1, message: "m".into() };
    let name = BackendError::UnknownBackendName { value: "tpu".into() };
    assert!(oom.is_device_failure());
    assert!(!name.is_device_failure());
    let wrapped = DecodeError::Pool(Box::new(PoolError::Backend(oom)));
    assert!(wrapped.is_device_failure());
    assert!(!PoolError::Backend(name).is_device_failure());
    assert!(!PoolError::Poisoned.is_device_failure());
}

#[test]
fn names_parse_in_the_library() {
    for c in Class::ALL {
        assert_eq!(Class::from_name(c.name()), Some(c));
    }
    assert_eq!(Class::from_name("hca"), Some(Class::Hca));
    assert_eq!(Class::from_name("HCA"), None);
    for c in Compressor::ALL {
        assert_eq!(Compressor::from_name(c.name()), Some(c));
    }
    assert_eq!(Compressor::from_name("csa_idx"), Some(Compressor::CsaIdx));
    assert_eq!(Compressor::from_name("idx"), None);
    let host = BackendChoice::parse("host").and_then(|c| backend::select_on(c, 0)).unwrap();
    assert_eq!(host.kind(), BackendKind::Host);
    assert_eq!(BackendChoice::parse("auto").unwrap(), BackendChoice::Auto);
    let e = BackendChoice::parse("tpu").unwrap_err();
    assert_eq!(e.variant_name(), "UnknownBackendName");
}
