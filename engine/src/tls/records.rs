//! What both TLS stream shapes ([`super::TlsStream`] and its split halves)
//! share: handing ciphertext to rustls, and borrowing the bytes of a
//! monoio write buffer.

use std::io;

use monoio::buf::{IoBuf, IoVecBuf};
use rustls::{ConnectionCommon, SideData};

/// Socket read size for ciphertext: one maximal TLS record.
pub(super) const CIPHERTEXT_READ_BYTES: usize = 16 * 1024 + 256;

/// What [`feed_ciphertext`] did.
pub(super) enum Fed {
    /// rustls took what it could; look for plaintext.
    Ok,
    /// rustls refused the bytes (its buffer is full or closed).
    Io(io::Error),
    /// The TLS session failed: a fatal alert from the peer, a record that
    /// does not decrypt, a protocol violation. rustls may have queued an
    /// alert to send.
    Tls(rustls::Error),
}

/// Hands rustls the ciphertext `scratch[*consumed..]`, advancing
/// `consumed`, and stops as soon as plaintext is ready (rustls refuses more
/// input while 16 KiB of plaintext wait to be read).
pub(super) fn feed_ciphertext<SD: SideData>(
    conn: &mut ConnectionCommon<SD>,
    scratch: &[u8],
    consumed: &mut usize,
) -> Fed {
    while *consumed < scratch.len() {
        let mut pending = &scratch[*consumed..];
        let taken = match conn.read_tls(&mut pending) {
            Ok(taken) => taken,
            Err(e) => return Fed::Io(e),
        };
        *consumed += taken;
        match conn.process_new_packets() {
            Ok(state) if state.plaintext_bytes_to_read() > 0 => break,
            Ok(_) if taken == 0 => {
                // rustls takes nothing more (bytes after the peer's
                // close_notify): drop them rather than offer them again
                // and again.
                *consumed = scratch.len();
                break;
            }
            Ok(_) => {}
            Err(e) => return Fed::Tls(e),
        }
    }
    Fed::Ok
}

/// The initialised bytes of `buf`, for as long as `buf` is borrowed.
pub(super) fn init_bytes<T: IoBuf>(buf: &T) -> &[u8] {
    // SAFETY: `read_ptr` points at `bytes_init()` initialised bytes that
    // `buf` owns and keeps alive while it is borrowed; the slice borrows it.
    unsafe { std::slice::from_raw_parts(buf.read_ptr(), buf.bytes_init()) }
}

/// The parts of a gathered write, for as long as `buf` is borrowed.
pub(super) fn iovec_parts<T: IoVecBuf>(buf: &T) -> Vec<&[u8]> {
    let ptr = buf.read_iovec_ptr();
    (0..buf.read_iovec_len())
        .map(|i| {
            // SAFETY: `buf` describes `read_iovec_len()` iovecs, each
            // pointing at `iov_len` initialised bytes it keeps alive while it
            // is borrowed; the slices borrow it.
            unsafe {
                let iov = &*ptr.add(i);
                std::slice::from_raw_parts(iov.iov_base.cast::<u8>(), iov.iov_len)
            }
        })
        .collect()
}
