//! [`VariantName`]: the name of an error's variant, as the bindings and `v4pool ... --json`
//! report it. Every error enum of the library is defined inside [`variant_names!`], which
//! writes its implementation from the enum itself, so no caller reads an error's `Debug` text
//! or matches variant-name strings, and no list of names is kept beside the enum.

/// The name of the variant an error value is; a variant that wraps another module's error
/// reports the wrapped one's (the innermost), so a geometry error inside a pool error reads
/// as the geometry's variant.
pub trait VariantName {
    /// The variant's name (innermost for wrapped errors).
    fn variant_name(&self) -> &'static str;

    /// Whether the innermost error is the device's failure (a driver absent or failing, out
    /// of memory, a kernel missing or failing to compile or launch) rather than a refusal of
    /// the caller's input: the C ABI's `V4POOL_BACKEND` status. Wrappers delegate; the
    /// default is a refusal.
    fn is_device_failure(&self) -> bool {
        false
    }
}

impl<T: VariantName + ?Sized> VariantName for Box<T> {
    fn variant_name(&self) -> &'static str {
        (**self).variant_name()
    }
    fn is_device_failure(&self) -> bool {
        (**self).is_device_failure()
    }
}

/// Defines an error enum and its [`VariantName`] in one place, so a variant added to the enum
/// is named without a second list to keep in step:
///
/// ```text
/// variant_names! {
/// /// What went wrong.
/// #[derive(Debug, thiserror::Error)]
/// pub enum SomeError {
///     #[error("...")] Leaf { at: u64 },
///     #[error(transparent)] Wrapped(#[from] OtherError),
/// }
/// device = [Leaf];       // optional: leaves that are the device's failure
/// via_source = [Named];  // optional: struct variants named by their `source` field
/// }
/// ```
///
/// A variant is its own name unless it wraps one value (a one-field tuple variant) whose type
/// implements `VariantName`: then it is the wrapped value's name, and its device failure the
/// wrapped value's (resolved by type at the definition; a payload that is no error, such as
/// a `Class`, leaves the outer name standing). `via_source` struct variants delegate through
/// their `source` field the same way; `device` lists the leaves that are the device's failure
/// (every other leaf is a refusal of the caller's input).
macro_rules! variant_names {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident { $($body:tt)* }
        $(device = [$($dev:ident),* $(,)?];)?
        $(via_source = [$($src:ident),* $(,)?];)?
    ) => {
        $(#[$meta])*
        $vis enum $name { $($body)* }

        impl $crate::variant::VariantName for $name {
            fn variant_name(&self) -> &'static str {
                #[allow(unused_imports)]
                use $crate::variant::{Payload as _, Wrapped as _};
                #[allow(unreachable_patterns)]
                match self {
                    $($( $name::$src { source, .. } => (&$crate::variant::Probe(source)).name(stringify!($src)), )*)?
                    _ => $crate::variant::variant_names!(@arms name self [] $($body)*),
                }
            }
            fn is_device_failure(&self) -> bool {
                #[allow(unused_imports)]
                use $crate::variant::{Payload as _, Wrapped as _};
                #[allow(unreachable_patterns)]
                match self {
                    $($( $name::$dev { .. } => true, )*)?
                    $($( $name::$src { source, .. } => (&$crate::variant::Probe(source)).device(), )*)?
                    _ => $crate::variant::variant_names!(@arms device self [] $($body)*),
                }
            }
        }
    };
    // Every variant read: the match.
    (@arms $mode:ident $s:ident [$($acc:tt)*]) => {
        match $s { $($acc)* }
    };
    // One unnamed field: named by it where its type names variants.
    (@arms $mode:ident $s:ident [$($acc:tt)*]
        $(#[$m:meta])* $v:ident ( $(#[$fm:meta])* $fty:ty $(,)? ) $(, $($rest:tt)*)?
    ) => {
        $crate::variant::variant_names!(@arms $mode $s
            [$($acc)* Self::$v(inner) => $crate::variant::variant_names!(@wrap $mode inner $v),]
            $($($rest)*)?)
    };
    // Any other variant (unit, several fields, named fields): its own name.
    (@arms $mode:ident $s:ident [$($acc:tt)*]
        $(#[$m:meta])* $v:ident $(( $($tf:tt)* ))? $({ $($sf:tt)* })? $(, $($rest:tt)*)?
    ) => {
        $crate::variant::variant_names!(@arms $mode $s
            [$($acc)* Self::$v { .. } => $crate::variant::variant_names!(@leaf $mode $v),]
            $($($rest)*)?)
    };
    (@wrap name $inner:ident $v:ident) => { (&$crate::variant::Probe($inner)).name(stringify!($v)) };
    (@wrap device $inner:ident $v:ident) => { (&$crate::variant::Probe($inner)).device() };
    (@leaf name $v:ident) => { stringify!($v) };
    (@leaf device $v:ident) => { false };
}
pub(crate) use variant_names;

/// A variant's payload, asked for its name: [`Wrapped`] where the payload implements
/// [`VariantName`], [`Payload`] (the outer name) where it does not. Method resolution picks
/// the first by autoref, so the choice is made by the payload's type where `variant_names!`
/// expands; nothing runs at run time but the one call.
#[doc(hidden)]
pub struct Probe<'a, T: ?Sized>(pub &'a T);

/// The payload is an error with variants: its innermost name and device flag.
#[doc(hidden)]
pub trait Wrapped {
    /// The payload's innermost variant name.
    fn name(&self, outer: &'static str) -> &'static str;
    /// The payload's device-failure flag.
    fn device(&self) -> bool;
}

impl<T: VariantName + ?Sized> Wrapped for Probe<'_, T> {
    fn name(&self, _outer: &'static str) -> &'static str {
        self.0.variant_name()
    }
    fn device(&self) -> bool {
        self.0.is_device_failure()
    }
}

/// The payload is plain data: the outer variant's name, a refusal.
#[doc(hidden)]
pub trait Payload {
    /// `outer`: the variant's own name.
    fn name(&self, outer: &'static str) -> &'static str;
    /// A refusal, never the device's failure.
    fn device(&self) -> bool;
}

impl<T: ?Sized> Payload for &Probe<'_, T> {
    fn name(&self, outer: &'static str) -> &'static str {
        outer
    }
    fn device(&self) -> bool {
        false
    }
}
