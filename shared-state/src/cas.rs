//! Read-modify-write over a [`Store`] with CAS and bounded retries.

use crate::{Store, StoreError};

/// How often a read-modify-write is retried after losing a CAS race before
/// giving up. Contention is between a handful of worker VMs, so a race lost
/// 64 times in a row means something is wrong; the caller counts it.
pub const MAX_CAS_RETRIES: u32 = 64;

/// Outcome of [`update`].
#[derive(Debug, PartialEq, Eq)]
pub struct Updated<R> {
    pub result: R,
    /// CAS races lost before the write went through.
    pub retries: u32,
}

/// Reads `key`, lets `f` change the decoded value, and writes it back with
/// the CAS token of the read, retrying from a fresh read on a lost race.
///
/// `decode` gets `None` for a key that was never set. `f` returns `None` to
/// leave the value unchanged (nothing is written).
///
/// Envoy applies a set on a missing key unconditionally, whatever the CAS
/// token. So a missing key is first created holding the *initial* value
/// (`encode(decode(None))`), and the change is then made by CAS against
/// that: two writers that both find the key missing overwrite only each
/// other's initial values, never each other's changes. The one window left is
/// a writer that found the key missing and creates it after another writer
/// has already created it and changed it; callers that cannot afford that
/// create their keys before traffic (see `Engine::ensure_tables`).
pub fn update<T, R>(
    store: &dyn Store,
    key: &str,
    decode: impl Fn(Option<&[u8]>) -> T,
    encode: impl Fn(&T) -> Vec<u8>,
    f: impl FnMut(&mut T) -> Option<R>,
) -> Result<Updated<Option<R>>, StoreError> {
    update_seeded(store, key, None, decode, encode, f)
}

/// [`update`], with the first attempt made on a value the caller has already
/// read (`seed`: the decoded value and the CAS token it was read with), which
/// saves a get when nobody wrote the key in between. A lost race retries
/// from a fresh read, as [`update`] does.
pub fn update_seeded<T, R>(
    store: &dyn Store,
    key: &str,
    seed: Option<(T, u32)>,
    decode: impl Fn(Option<&[u8]>) -> T,
    encode: impl Fn(&T) -> Vec<u8>,
    f: impl FnMut(&mut T) -> Option<R>,
) -> Result<Updated<Option<R>>, StoreError> {
    cas_loop(
        store,
        key,
        seed,
        || encode(&decode(None)),
        |bytes| decode(Some(&bytes)),
        |value, cas| store.set(key, &encode(value), cas),
        f,
    )
}

/// [`update`] for a value that is its own encoding (a byte buffer changed in
/// place): no decode or encode copies. `init` is the value of a key that was
/// never set, and `fix` normalises whatever was read (e.g. to a fixed size).
/// Same CAS, creation and retry rules as [`update`].
///
/// `seed`, like [`update_seeded`]'s: bytes already read with their CAS token
/// (`fix` is applied to them too), tried first instead of a get.
pub fn update_bytes<R>(
    store: &dyn Store,
    key: &str,
    seed: Option<(Vec<u8>, u32)>,
    init: impl Fn() -> Vec<u8>,
    fix: impl Fn(&mut Vec<u8>),
    f: impl FnMut(&mut Vec<u8>) -> Option<R>,
) -> Result<Updated<Option<R>>, StoreError> {
    let seed = seed.map(|(mut bytes, cas)| {
        fix(&mut bytes);
        (bytes, cas)
    });
    cas_loop(
        store,
        key,
        seed,
        init,
        |mut bytes| {
            fix(&mut bytes);
            bytes
        },
        |value, cas| store.set(key, value, cas),
        f,
    )
}

/// The loop behind [`update_seeded`] and [`update_bytes`]: `create` is the
/// encoded initial value of a missing key, `read` turns fetched bytes into
/// the value `f` changes, and `write` sets it with a CAS token.
fn cas_loop<T, R>(
    store: &dyn Store,
    key: &str,
    mut seed: Option<(T, u32)>,
    create: impl Fn() -> Vec<u8>,
    read: impl Fn(Vec<u8>) -> T,
    write: impl Fn(&T, u32) -> Result<(), StoreError>,
    mut f: impl FnMut(&mut T) -> Option<R>,
) -> Result<Updated<Option<R>>, StoreError> {
    let mut retries = 0;
    let mut created = false;
    loop {
        let (mut value, cas) = match seed.take() {
            Some(s) => s,
            None => {
                let Some((bytes, cas)) = store.get(key)? else {
                    if created {
                        return Err(StoreError::Host(format!(
                            "{key} is still missing after it was written"
                        )));
                    }
                    store.set(key, &create(), 0)?;
                    created = true;
                    continue;
                };
                (read(bytes), cas)
            }
        };
        let Some(result) = f(&mut value) else {
            return Ok(Updated {
                result: None,
                retries,
            });
        };
        match write(&value, cas) {
            Ok(()) => {
                return Ok(Updated {
                    result: Some(result),
                    retries,
                })
            }
            Err(StoreError::CasMismatch) if retries < MAX_CAS_RETRIES => retries += 1,
            Err(e) => return Err(e),
        }
    }
}
