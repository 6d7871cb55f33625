//! Borrowed, typed views of provider bodies (issue 13 item 6): what an adapter reads of a
//! body, deserialized straight from its bytes, strings borrowed where they need no unescaping,
//! every other field skipped. A view is an optimization of a reader over the JSON tree, never
//! a second reading: it accepts only bodies in which every field it reads has the type the
//! tree reader expects there (an object where an object is read, a string where a string is,
//! no field twice), and the caller reads the tree for any other body. So where a view answers,
//! the tree reader would have answered the same (checked against it in
//! `tests/it/fuzz.rs`, `a_typed_view_reads_what_the_tree_reader_reads`).
//!
//! A view reads every member it does not use as the strict tree reader
//! ([`crate::strict_json::from_slice`]) would read it and keeps nothing ([`members`], with
//! [`crate::strict_json::Readable`]): the grammar, string escapes and lone surrogates, the
//! number range (`1e400` is refused), the nesting limit, and no key twice in any object. So the
//! one pass that reads the view also checks that a tree could be read from the body (DESIGN.md
//! §9: nothing passes that turnguard could not read); a body that fails it is refused by the
//! view, and its tree fails too.

use std::borrow::Cow;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

/// A struct read from a JSON object by [`Obj`]: its members in one pass ([`members`]).
pub trait ObjectView<'de>: Sized {
    /// Reads the object's members from `map`.
    ///
    /// Errors: a member it reads has another type, or comes twice ([`once`]); a member it
    /// does not read is not one serde_json's tree reads.
    fn read<A: MapAccess<'de>>(map: A) -> Result<Self, A::Error>;
}

/// A JSON object read as `T`; anything else (an array, which serde's derived structs also
/// accept field by field) is refused.
#[derive(Debug)]
pub struct Obj<T>(pub T);

impl<'de, T: ObjectView<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Only<T>(PhantomData<T>);

        impl<'de, T: ObjectView<'de>> Visitor<'de> for Only<T> {
            type Value = T;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::read(map)
            }
        }

        d.deserialize_map(Only(PhantomData)).map(Obj)
    }
}

/// Reads an object's members: `read` gets each member's name (escapes decoded, as a tree's
/// key) with the map positioned at its value, reads the value and answers `true`, or answers
/// `false` for a name it does not read; that value is then read as
/// [`crate::strict_json::from_slice`] reads it and dropped ([`crate::strict_json::Readable`]).
///
/// Errors: whatever `read` or the value's reading fails with, and a name that comes twice,
/// read or not (a skipped member is forwarded as it came, so a repeat there would reach the
/// agent read two ways; the strict tree refuses it too).
pub fn members<'de, A, F>(mut map: A, mut read: F) -> Result<(), A::Error>
where
    A: MapAccess<'de>,
    F: FnMut(&str, &mut A) -> Result<bool, A::Error>,
{
    let mut names = crate::strict_json::KeySet::default();
    while let Some(Str(name)) = map.next_key::<Str<'de>>()? {
        if names.contains(&name) {
            return Err(crate::strict_json::duplicate(&name));
        }
        if !read(&name, &mut map)? {
            map.next_value_seed(crate::strict_json::Readable)?;
        }
        names.insert(name);
    }
    Ok(())
}

/// Reads member `name`'s value into `slot` (`Some` once read, even when the value is
/// `null`): a member read twice is an error, so the view refuses a body with a repeated key
/// it reads (a tree keeps the last one; the caller then reads the tree). Answers `true`.
pub fn once<'de, A, T>(
    map: &mut A,
    slot: &mut Option<T>,
    name: &'static str,
) -> Result<bool, A::Error>
where
    A: MapAccess<'de>,
    T: Deserialize<'de>,
{
    if slot.is_some() {
        return Err(serde::de::Error::duplicate_field(name));
    }
    *slot = Some(map.next_value()?);
    Ok(true)
}

/// A JSON string, borrowed from the body when it has no escapes (a `Cow<str>` field is
/// always copied by serde's derive).
#[derive(Debug)]
pub struct Str<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for Text<'a> {
            type Value = Str<'a>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON string")
            }

            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }

            fn visit_str<E>(self, v: &str) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E>(self, v: String) -> Result<Str<'a>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }

        d.deserialize_str(Text(PhantomData))
    }
}

impl Str<'_> {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The text, owned (a copy only when it is borrowed).
    pub fn into_owned(self) -> String {
        self.0.into_owned()
    }
}

/// Implements [`ObjectView`] for a view whose every field is read from the member of the same
/// name with [`once`] (a second one is refused). A field is `Option<_>`, read as
/// `Option<Option<_>>` and flattened: `null` reads as missing, as a tree reader reads it;
/// the fields listed after `keep_null` refuse `null` instead (the caller refuses that
/// structure), and a member named after `refuse` makes the view refuse the object (the caller
/// reads it from the tree).
///
/// `object_view!(View<'a> { field, … } keep_null { field, … } refuse { "name", … });`, the last
/// two parts optional.
macro_rules! object_view {
    ($view:ident $(<$lt:lifetime>)? { $($field:ident),* $(,)? }
        $(keep_null { $($strict:ident),+ })? $(refuse { $($refused:literal),+ })?) => {
        impl<'de $(: $lt, $lt)?> $crate::provider::view::ObjectView<'de> for $view $(<$lt>)? {
            fn read<A: ::serde::de::MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
                use $crate::provider::view::once;
                $(let mut $field = None;)*
                $($(let mut $strict = None;)+)?
                $crate::provider::view::members(map, |name, map| {
                    $(if name == stringify!($field) {
                        return once(map, &mut $field, stringify!($field));
                    })*
                    $($(if name == stringify!($strict) {
                        return once(map, &mut $strict, stringify!($strict));
                    })+)?
                    $($(if name == $refused {
                        return Err(::serde::de::Error::custom(concat!(
                            "`", $refused, "` is read from the tree"
                        )));
                    })+)?
                    Ok(false)
                })?;
                Ok(Self {
                    $($field: $field.flatten(),)*
                    $($($strict: match $strict {
                        Some(None) => {
                            return Err(::serde::de::Error::custom(concat!(
                                "`", stringify!($strict), "` is null"
                            )))
                        }
                        other => other.flatten(),
                    },)+)?
                })
            }
        }
    };
}
pub(crate) use object_view;
