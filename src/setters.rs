//! `with_*` setters for the `#[non_exhaustive]` config and capacity structs.
//!
//! A struct an engine builds is `#[non_exhaustive]` so that adding a field is not a break; code
//! outside the crate then cannot write it as a literal, and builds it from a constructor
//! (`new`, `Default`, `for_pool`) and these by-value setters for the optional fields.

/// `with_setters!(Type { with_a(a: u32), with_b(b: Some(Thing)) })`: one by-value setter per
/// field; `Some(T)` takes the `T` of an `Option<T>` field and stores it as `Some`. A struct
/// with a lifetime opens with it: `with_setters!(impl<'a> Seq<'a> { with_rows(rows: &'a [u8]) })`.
macro_rules! with_setters {
    (impl<$lt:lifetime> $ty:ty { $($name:ident ($($item:tt)*)),* $(,)? }) => {
        impl<$lt> $ty {
            $( $crate::setters::with_setters!(@one $name $($item)*); )*
        }
    };
    ($ty:ty { $($name:ident ($($item:tt)*)),* $(,)? }) => {
        impl $ty {
            $( $crate::setters::with_setters!(@one $name $($item)*); )*
        }
    };
    (@one $name:ident $field:ident : Some($fty:ty)) => {
        #[doc = concat!("Sets [`", stringify!($field), "`](Self::", stringify!($field),
            ") to `Some` (builder style).")]
        #[must_use]
        pub fn $name(mut self, $field: $fty) -> Self {
            self.$field = Some($field);
            self
        }
    };
    (@one $name:ident $field:ident : $fty:ty) => {
        #[doc = concat!("Sets [`", stringify!($field), "`](Self::", stringify!($field),
            ") (builder style).")]
        #[must_use]
        pub fn $name(mut self, $field: $fty) -> Self {
            self.$field = $field;
            self
        }
    };
}
pub(crate) use with_setters;
