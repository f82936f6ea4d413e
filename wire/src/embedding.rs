//! The vectors of an embeddings run as they travel on `RunEvent.embeddings`:
//! little-endian IEEE 754 `f32`s, vector after vector, each
//! `RunEvent.embedding_dimensions` long. Pure; decoding checks the lengths
//! before it allocates.

use bytes::{BufMut, Bytes, BytesMut};

/// Why `RunEvent.embeddings` cannot be read as vectors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EmbeddingsError {
    /// Vectors without a length.
    #[error("embeddings of {bytes} bytes with no dimension")]
    NoDimension {
        /// Bytes carried.
        bytes: usize,
    },
    /// The bytes are not a whole number of vectors.
    #[error("embeddings of {bytes} bytes are no whole number of {dimensions}-float vectors")]
    Ragged {
        /// Bytes carried.
        bytes: usize,
        /// The vector length claimed.
        dimensions: u32,
    },
}

/// Packs `vectors` (all of one length) into the wire form.
pub fn pack<'a>(vectors: impl IntoIterator<Item = &'a [f32]>) -> Bytes {
    let mut out = BytesMut::new();
    for vector in vectors {
        for x in vector {
            out.put_f32_le(*x);
        }
    }
    out.freeze()
}

/// The vectors of `bytes`, each `dimensions` long, in order.
pub fn unpack(bytes: &[u8], dimensions: u32) -> Result<Vec<Vec<f32>>, EmbeddingsError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let width = usize::try_from(dimensions)
        .ok()
        .filter(|&d| d > 0)
        .ok_or(EmbeddingsError::NoDimension { bytes: bytes.len() })?;
    let vector_bytes = width.saturating_mul(4);
    if bytes.len() % vector_bytes != 0 {
        return Err(EmbeddingsError::Ragged {
            bytes: bytes.len(),
            dimensions,
        });
    }
    Ok(bytes
        .chunks_exact(vector_bytes)
        .map(|v| {
            v.chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_round_trip_as_little_endian_f32() {
        let a = [1.0f32, -0.5];
        let b = [0.25f32, f32::MIN_POSITIVE];
        let packed = pack([&a[..], &b[..]]);
        assert_eq!(
            &packed[..8],
            &[0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xbf]
        );
        assert_eq!(packed.len(), 16);
        assert_eq!(unpack(&packed, 2), Ok(vec![a.to_vec(), b.to_vec()]));
        assert_eq!(unpack(&[], 0), Ok(vec![]));
        assert_eq!(
            unpack(&packed, 3),
            Err(EmbeddingsError::Ragged {
                bytes: 16,
                dimensions: 3
            })
        );
        assert_eq!(
            unpack(&packed, 0),
            Err(EmbeddingsError::NoDimension { bytes: 16 })
        );
    }
}
