//! The handshake driver: moves bytes between a monoio socket and a rustls
//! connection until the handshake completes or fails.
//!
//! monoio-rustls has its own driver, but when rustls fails a handshake it
//! writes only the first queued TLS chunk before giving up. A TLS 1.3 client
//! that rejects the server certificate has two queued (the middlebox
//! `ChangeCipherSpec`, then the alert), so the server saw a bare EOF instead
//! of `access_denied`, depending on how the reads happened to split. This
//! driver flushes everything rustls queued, alert included, on every exit.
//!
//! Everything read from the socket is handed to rustls before returning, so
//! wrapping the connection in a [`super::TlsStream`] afterwards loses no
//! bytes (rustls keeps any early application data buffered).

use std::io;
use std::ops::{Deref, DerefMut};

use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use rustls::{ConnectionCommon, SideData};

use super::TlsError;

/// Socket read size during the handshake: one maximal TLS record.
const HANDSHAKE_READ_BYTES: usize = 16 * 1024 + 256;

/// Runs the handshake of `conn` over `io` to completion.
///
/// On a rustls failure the queued alert is sent (best effort) before the
/// error is returned. Dropping the future (a handshake deadline) is safe: the
/// caller drops the socket and the connection with it.
pub(crate) async fn complete<IO, C, SD>(io: &mut IO, conn: &mut C) -> Result<(), TlsError>
where
    IO: AsyncReadRent + AsyncWriteRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    let mut out = Vec::new();
    let mut input = Vec::with_capacity(HANDSHAKE_READ_BYTES);
    loop {
        flush(io, conn, &mut out).await.map_err(TlsError::Io)?;
        if !conn.is_handshaking() {
            return Ok(());
        }
        if !conn.wants_read() {
            // rustls is handshaking yet wants neither to read nor to write:
            // no progress is possible.
            return Err(TlsError::Io(io::Error::other(
                "TLS handshake stalled: rustls wants neither to read nor to write",
            )));
        }
        input.clear();
        let (res, buf) = io.read(input).await;
        input = buf;
        let read_bytes = res.map_err(TlsError::Io)?;
        if read_bytes == 0 {
            return Err(TlsError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection during the TLS handshake",
            )));
        }
        let mut pending = &input[..read_bytes];
        while !pending.is_empty() {
            let consumed = conn.read_tls(&mut pending).map_err(TlsError::Io)?;
            if let Err(e) = conn.process_new_packets() {
                // Best effort: the handshake already failed; the alert is a
                // courtesy to the peer's logs.
                let _ = flush(io, conn, &mut out).await;
                return Err(TlsError::Handshake(e));
            }
            if consumed == 0 {
                return Err(TlsError::Io(io::Error::other(
                    "TLS handshake stalled: rustls accepted no input",
                )));
            }
        }
    }
}

/// Writes everything rustls has queued.
async fn flush<IO, C, SD>(io: &mut IO, conn: &mut C, out: &mut Vec<u8>) -> io::Result<()>
where
    IO: AsyncWriteRent,
    C: DerefMut + Deref<Target = ConnectionCommon<SD>>,
    SD: SideData,
{
    while conn.wants_write() {
        out.clear();
        // `Vec`'s vectored write takes every queued chunk at once.
        conn.write_tls(out)?;
        let (res, buf) = io.write_all(std::mem::take(out)).await;
        *out = buf;
        res?;
    }
    Ok(())
}
