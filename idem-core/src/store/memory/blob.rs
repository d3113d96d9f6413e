//! The layout of a completed record's buffer.

use bytes::Bytes;

use super::clock::Nanos;
use super::name::Name;
use crate::store::StoreError;
use crate::{Fingerprint, StoredResponse};

/// The layout of a completed record's buffer: a fixed head, then the
/// fingerprint, the scope, the key, the encoded header fields
/// ([`StoredResponse::encode_headers`]) and the body.
pub(super) struct Blob;

impl Blob {
    const EXPIRES_AT: usize = 0; // u64
    const GENERATION: usize = 8; // u32
    const HEADERS_LEN: usize = 12; // u32
    const SCOPE_LEN: usize = 16; // u32
    const STATUS: usize = 20; // u16
    const KEY_LEN: usize = 22; // u8
    const FLAGS: usize = 23; // u8: bit 0, replayable
    const FINGERPRINT: usize = 24;
    pub(super) const SCOPE: usize = 56;

    #[allow(clippy::too_many_arguments)]
    pub(super) fn encode(
        name: &Name<'_>,
        fingerprint: &Fingerprint,
        generation: u32,
        expires_at: Nanos,
        response: &StoredResponse,
        headers_len: usize,
        keep_body: bool,
    ) -> Bytes {
        let body: &[u8] = if keep_body { &response.body } else { &[] };
        let len = Self::SCOPE + name.scope.len() + name.key.len() + headers_len + body.len();
        let mut blob = Vec::with_capacity(len);
        blob.extend_from_slice(&expires_at.to_le_bytes());
        blob.extend_from_slice(&generation.to_le_bytes());
        blob.extend_from_slice(&(headers_len as u32).to_le_bytes());
        blob.extend_from_slice(&(name.scope.len() as u32).to_le_bytes());
        blob.extend_from_slice(&response.status.to_le_bytes());
        // Keys are at most 255 bytes long.
        blob.push(name.key.len() as u8);
        blob.push(u8::from(keep_body && response.replayable));
        blob.extend_from_slice(fingerprint.as_bytes());
        blob.extend_from_slice(name.scope);
        blob.extend_from_slice(name.key);
        response.encode_headers_into(&mut blob);
        blob.extend_from_slice(body);
        // Exactly as long as its allocation, so `Bytes` takes it without copying.
        Bytes::from(blob)
    }

    fn u32_at(blob: &[u8], at: usize) -> u32 {
        let mut bytes = [0; 4];
        bytes.copy_from_slice(&blob[at..at + 4]);
        u32::from_le_bytes(bytes)
    }

    pub(super) fn expires_at(blob: &[u8]) -> Nanos {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(&blob[Self::EXPIRES_AT..Self::EXPIRES_AT + 8]);
        u64::from_le_bytes(bytes)
    }

    pub(super) fn generation(blob: &[u8]) -> u32 {
        Self::u32_at(blob, Self::GENERATION)
    }

    pub(super) fn scope(blob: &[u8]) -> &[u8] {
        let len = Self::u32_at(blob, Self::SCOPE_LEN) as usize;
        &blob[Self::SCOPE..Self::SCOPE + len]
    }

    pub(super) fn key_range(blob: &[u8]) -> std::ops::Range<usize> {
        let start = Self::SCOPE + Self::u32_at(blob, Self::SCOPE_LEN) as usize;
        start..start + usize::from(blob[Self::KEY_LEN])
    }

    pub(super) fn fingerprint(blob: &[u8]) -> Fingerprint {
        let mut bytes = [0; 32];
        bytes.copy_from_slice(&blob[Self::FINGERPRINT..Self::FINGERPRINT + 32]);
        Fingerprint::from_bytes(bytes)
    }

    /// The stored answer; its header values and body are slices of `blob`.
    pub(super) fn response(blob: &Bytes) -> Result<StoredResponse, StoreError> {
        let headers_start = Self::key_range(blob).end;
        let body_start = headers_start + Self::u32_at(blob, Self::HEADERS_LEN) as usize;
        let headers = StoredResponse::decode_shared_headers(blob, headers_start..body_start)
            .ok_or_else(|| StoreError::Corrupt("an in-memory record's headers".to_owned()))?;
        Ok(StoredResponse {
            status: u16::from_le_bytes([blob[Self::STATUS], blob[Self::STATUS + 1]]),
            headers,
            body: blob.slice(body_start..),
            replayable: blob[Self::FLAGS] & 1 == 1,
        })
    }
}
