//! Fixed-size pooled IO buffers for the zero-copy relay path.
//!
//! ```text
//!                 acquire                read (owned IO)            freeze
//! BufferPool ─────────────► PooledBuf ─────────────────► PooledBuf ────────► Bytes ─► slices, clones,
//!  (one per core)               │ Drop (same core; also a late            │           mailbox to other cores
//!      ▲   ▲                    │ drop after a cancelled io_uring read)   │
//!      │   └────────────────────┘                                         │ last clone dropped
//!      │                                                                  ▼ (on ANY thread)
//!      └──── drained on acquire / counter read ◄──── return queue (Arc + Mutex)
//! ```
//!
//! # Design
//!
//! * **Arena.** Each [`BufferPool`] owns a slab of at most
//!   [`PoolConfig::buffer_count_max`] slots. A slot is allocated lazily the
//!   first time it is needed and is never freed while the pool lives, so a
//!   steady acquire/release cycle does not touch the allocator
//!   ([`BufferPool::allocated`] stays constant). Free slots are reused LIFO so
//!   the hottest buffer stays in cache.
//! * **Ownership, not aliasing.** While a buffer is out on loan its memory (a
//!   `Box<[MaybeUninit<u8>]>`) is *moved* out of the slot into the
//!   [`PooledBuf`] (and later into the frozen `Bytes` owner). Nothing else
//!   points at it, so no unsafe aliasing is needed; the `unsafe` here is
//!   the `IoBuf`/`IoBufMut` contract monoio requires, the view of a
//!   buffer's filled prefix as bytes, and packed reads (below).
//! * **Generation-checked handles.** Every loan carries a [`BufferId`] (slot
//!   index + generation, bumped on each loan). A return whose id does not match
//!   a slot that is currently on loan is *stale*: the memory is freed, counted
//!   in [`BufferPool::stale_returns`], and never put into the free list twice.
//! * **Two return paths.** A [`PooledBuf`] is `!Send` and returns straight
//!   into its pool's slab through a `Weak` (a late drop after the pool is gone
//!   just frees the memory). A frozen `Bytes` may travel to another core, so
//!   its owner holds an `Arc` to the pool's return queue (a mutex-protected
//!   vector) and pushes the memory there when the last clone is dropped, on
//!   whatever thread that happens; the owning core drains the queue on its
//!   next acquire or counter read. If the pool was dropped meanwhile, the
//!   queue is closed and the memory is freed.
//! * **Packed reads.** [`BufferPool::read_packed`] lends one buffer to many
//!   small reads: each non-blocking read fills the tail after the previous
//!   one and becomes a `Bytes` over just its bytes. A streamed body's
//!   pieces (a few hundred bytes each, from many connections) then share a
//!   buffer instead of holding one each until they are written on. This is
//!   the one place a buffer's memory is shared rather than moved: every
//!   piece reads only bytes filled before it was made, and only the owning
//!   core writes, and only past every piece. The buffer goes home when its
//!   last piece drops (the pool keeps just a weak reference to where the
//!   next read goes).
//! * **Exhaustion.** [`BufferPool::try_acquire`] returns `None` when every
//!   slot is on loan; [`BufferPool::acquire`] then allocates a fresh unpooled
//!   buffer instead, counted in [`BufferPool::overflow_allocations`], which is
//!   freed (not pooled) when dropped.
//!
//! The memory of a buffer is left uninitialized when it is allocated: the
//! pages a read never reaches are never touched, so a 16 KiB buffer that
//! carries 300-byte tokens costs one page of resident memory, not four.
//! Only the filled prefix (`len`: bytes copied in, or written by the kernel
//! and declared with `set_init`) is ever read. A reused buffer still holds
//! its previous contents beyond the current length.
//!
//! `freeze` costs one small heap allocation (the `Bytes` owner box that
//! `Bytes::from_owner` creates); the body bytes are never copied.

use std::cell::RefCell;
use std::fmt;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use monoio::buf::{IoBuf, IoBufMut};
use thiserror::Error;

/// Largest accepted [`PoolConfig::buffer_size_bytes`] (16 MiB).
pub const BUFFER_SIZE_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Largest accepted [`PoolConfig::buffer_count_max`] (2^20 buffers per pool).
pub const BUFFER_COUNT_MAX: usize = 1 << 20;

/// Default [`PoolConfig::buffer_size_bytes`]: 16 KiB, one maximal TLS record.
pub const DEFAULT_BUFFER_SIZE_BYTES: usize = 16 * 1024;

/// Default [`PoolConfig::buffer_count_max`]: 1024 buffers (16 MiB per core at
/// the default buffer size, allocated lazily).
pub const DEFAULT_BUFFER_COUNT_MAX: usize = 1024;

/// Sizing of one [`BufferPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Size of every pooled buffer, in bytes (`1..=BUFFER_SIZE_BYTES_MAX`).
    pub buffer_size_bytes: usize,
    /// Most pooled buffers that may exist at once (`1..=BUFFER_COUNT_MAX`).
    pub buffer_count_max: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            buffer_size_bytes: DEFAULT_BUFFER_SIZE_BYTES,
            buffer_count_max: DEFAULT_BUFFER_COUNT_MAX,
        }
    }
}

/// Why a [`PoolConfig`] was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum PoolConfigError {
    /// `buffer_size_bytes` is zero.
    #[error("buffer_size_bytes must be at least 1")]
    BufferSizeZero,
    /// `buffer_size_bytes` is above [`BUFFER_SIZE_BYTES_MAX`].
    #[error("buffer_size_bytes {buffer_size_bytes} exceeds the maximum {max_bytes}")]
    BufferSizeTooLarge {
        /// The configured size.
        buffer_size_bytes: usize,
        /// The largest accepted size.
        max_bytes: usize,
    },
    /// `buffer_count_max` is zero.
    #[error("buffer_count_max must be at least 1")]
    BufferCountZero,
    /// `buffer_count_max` is above [`BUFFER_COUNT_MAX`].
    #[error("buffer_count_max {buffer_count_max} exceeds the maximum {max_count}")]
    BufferCountTooLarge {
        /// The configured count.
        buffer_count_max: usize,
        /// The largest accepted count.
        max_count: usize,
    },
}

impl PoolConfig {
    /// Checks both fields against their limits.
    pub fn validate(&self) -> Result<(), PoolConfigError> {
        if self.buffer_size_bytes == 0 {
            return Err(PoolConfigError::BufferSizeZero);
        }
        if self.buffer_size_bytes > BUFFER_SIZE_BYTES_MAX {
            return Err(PoolConfigError::BufferSizeTooLarge {
                buffer_size_bytes: self.buffer_size_bytes,
                max_bytes: BUFFER_SIZE_BYTES_MAX,
            });
        }
        if self.buffer_count_max == 0 {
            return Err(PoolConfigError::BufferCountZero);
        }
        if self.buffer_count_max > BUFFER_COUNT_MAX {
            return Err(PoolConfigError::BufferCountTooLarge {
                buffer_count_max: self.buffer_count_max,
                max_count: BUFFER_COUNT_MAX,
            });
        }
        Ok(())
    }
}

/// A snapshot of a pool's counters, read in one go by
/// [`BufferPool::stats`] (for tests and `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Pooled buffers on loan (see [`BufferPool::in_use`]).
    pub in_use: usize,
    /// Pooled buffers at home, ready to lend.
    pub available: usize,
    /// Pooled buffers allocated so far; never decreases.
    pub allocated: usize,
    /// Most pooled buffers the pool will ever allocate.
    pub capacity_max: usize,
    /// Unpooled buffers allocated because the pool was exhausted.
    pub overflow_allocations: u64,
    /// Returns rejected as stale (always 0 unless an invariant broke).
    pub stale_returns: u64,
}

/// Where a pointer lies inside a pool's memory; see [`BufferPool::locate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferLocation {
    /// Slab index of the pooled buffer that holds the address.
    pub index: u32,
    /// Offset of the address from the start of that buffer, in bytes.
    pub offset_bytes: usize,
}

/// Identity of one loan of a pooled buffer: slab index plus the slot's
/// generation at the time of the loan. A reused slot gets a new generation,
/// so an id from an earlier loan never matches it again (ABA guard).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufferId {
    index: u32,
    generation: u32,
}

impl BufferId {
    /// Slab index of the slot.
    pub fn index(self) -> u32 {
        self.index
    }

    /// Generation of the slot when this loan was made.
    pub fn generation(self) -> u32 {
        self.generation
    }
}

/// A per-core pool of fixed-size IO buffers.
///
/// Cloning the handle is cheap (`Rc`); all clones share one pool. The pool is
/// `!Send`: create one per core. Buffers and frozen `Bytes` may outlive every
/// handle; their memory is then freed instead of pooled.
#[derive(Clone)]
pub struct BufferPool {
    local: Rc<Local>,
}

/// The core-local part of a pool.
struct Local {
    config: PoolConfig,
    state: RefCell<State>,
    shared: Arc<Shared>,
}

/// Slab and counters, touched only on the owning core.
struct State {
    /// Every slot ever allocated; never shrinks while the pool lives.
    slots: Vec<Slot>,
    /// Indices of slots whose memory is at home, LIFO.
    free: Vec<u32>,
    /// Recycled vector swapped with the return queue when draining, so
    /// draining does not allocate.
    spare: Vec<Returned>,
    /// Unpooled buffers allocated because the pool was exhausted.
    overflow_allocations: u64,
    /// Returns whose id matched no slot on loan.
    stale_returns: u64,
    /// The buffer small reads are packed into ([`BufferPool::read_packed`]),
    /// while a piece cut from it still lives.
    packing: Option<Packing>,
}

/// Where the next packed read goes: the unused tail of a buffer that
/// earlier packed reads share. Held weakly, so the buffer goes home as soon
/// as its last piece is dropped, as an unpacked buffer would.
struct Packing {
    memory: std::sync::Weak<PackedMemory>,
    /// First byte no piece covers; the kernel writes from here.
    cursor_bytes: usize,
}

/// One arena slot.
struct Slot {
    /// Bumped on every loan.
    generation: u32,
    /// `Some` while the buffer is at home, `None` while on loan.
    memory: Option<Memory>,
    /// Address of the slot's heap memory. The allocation never moves (only
    /// the box pointer travels with a loan), so this identifies the
    /// buffer's bytes for [`BufferPool::locate`]; it is never dereferenced.
    base_addr: usize,
}

/// The thread-safe part of a pool: where frozen `Bytes` owners send memory
/// back from any thread.
struct Shared {
    queue: Mutex<ReturnQueue>,
}

struct ReturnQueue {
    /// Set when the pool is dropped; later returns just free their memory.
    pool_dropped: bool,
    returned: Vec<Returned>,
}

/// Memory on its way home.
struct Returned {
    id: BufferId,
    memory: Memory,
}

impl BufferPool {
    /// Creates an empty pool; buffers are allocated lazily on first use.
    pub fn new(config: PoolConfig) -> Result<Self, PoolConfigError> {
        config.validate()?;
        Ok(Self::with_valid_config(config))
    }

    /// Builds a pool from a config that already passed
    /// [`PoolConfig::validate`].
    fn with_valid_config(config: PoolConfig) -> Self {
        let local = Local {
            config,
            state: RefCell::new(State {
                slots: Vec::new(),
                free: Vec::new(),
                spare: Vec::new(),
                overflow_allocations: 0,
                stale_returns: 0,
                packing: None,
            }),
            shared: Arc::new(Shared {
                queue: Mutex::new(ReturnQueue {
                    pool_dropped: false,
                    returned: Vec::new(),
                }),
            }),
        };
        Self {
            local: Rc::new(local),
        }
    }

    /// The configuration this pool was built with.
    pub fn config(&self) -> PoolConfig {
        self.local.config
    }

    /// Size of every pooled buffer, in bytes.
    pub fn buffer_size_bytes(&self) -> usize {
        self.local.config.buffer_size_bytes
    }

    /// Lends a pooled buffer (length 0, capacity
    /// [`buffer_size_bytes`](Self::buffer_size_bytes)), or `None` when all
    /// [`capacity_max`](Self::capacity_max) buffers are on loan.
    pub fn try_acquire(&self) -> Option<PooledBuf> {
        let (id, memory) = self.local.take()?;
        Some(PooledBuf {
            memory,
            len_bytes: 0,
            origin: Origin::Pooled {
                id,
                home: Rc::downgrade(&self.local),
            },
        })
    }

    /// Lends a pooled buffer, or — when the pool is exhausted — allocates a
    /// fresh unpooled buffer of the same size, counted in
    /// [`overflow_allocations`](Self::overflow_allocations) and freed rather
    /// than pooled when dropped.
    pub fn acquire(&self) -> PooledBuf {
        if let Some(buf) = self.try_acquire() {
            return buf;
        }
        let mut state = self.local.state.borrow_mut();
        state.overflow_allocations = state.overflow_allocations.saturating_add(1);
        drop(state);
        PooledBuf {
            memory: fresh_memory(self.local.config.buffer_size_bytes),
            len_bytes: 0,
            origin: Origin::Overflow,
        }
    }

    /// Pooled buffers at home, ready to lend.
    pub fn available(&self) -> usize {
        let mut state = self.local.state.borrow_mut();
        state.drain(&self.local);
        state.free.len()
    }

    /// Pooled buffers on loan: held as [`PooledBuf`], as frozen `Bytes`, or
    /// by the kernel for an in-flight or cancelled IO operation. Overflow
    /// buffers are not counted.
    pub fn in_use(&self) -> usize {
        let mut state = self.local.state.borrow_mut();
        state.drain(&self.local);
        state.slots.len() - state.free.len()
    }

    /// Pooled buffers allocated so far (at home or on loan); at most
    /// [`capacity_max`](Self::capacity_max). Never decreases.
    pub fn allocated(&self) -> usize {
        self.local.state.borrow().slots.len()
    }

    /// Most pooled buffers this pool will ever allocate
    /// ([`PoolConfig::buffer_count_max`]).
    pub fn capacity_max(&self) -> usize {
        self.local.config.buffer_count_max
    }

    /// Unpooled buffers [`acquire`](Self::acquire) allocated because the pool
    /// was exhausted, since the pool was created.
    pub fn overflow_allocations(&self) -> u64 {
        self.local.state.borrow().overflow_allocations
    }

    /// Returns rejected because their [`BufferId`] matched no slot on loan
    /// (a stale handle). Always 0 unless an invariant was broken.
    pub fn stale_returns(&self) -> u64 {
        let mut state = self.local.state.borrow_mut();
        state.drain(&self.local);
        state.stale_returns
    }

    /// Every counter at once, after bringing home what other threads
    /// returned (one drain, so the numbers are consistent with each other).
    pub fn stats(&self) -> PoolStats {
        let mut state = self.local.state.borrow_mut();
        state.drain(&self.local);
        PoolStats {
            in_use: state.slots.len() - state.free.len(),
            available: state.free.len(),
            allocated: state.slots.len(),
            capacity_max: self.local.config.buffer_count_max,
            overflow_allocations: state.overflow_allocations,
            stale_returns: state.stale_returns,
        }
    }

    /// Which pooled buffer of this pool (at home or on loan) holds the byte
    /// at `ptr`, and at what offset; `None` for memory the pool never
    /// allocated (heap copies, overflow buffers, other pools). The pointer
    /// is only compared, never dereferenced. Linear in
    /// [`allocated`](Self::allocated): meant for tests that prove a `Bytes`
    /// is a slice of pooled memory (no copy), not for hot paths.
    pub fn locate(&self, ptr: *const u8) -> Option<BufferLocation> {
        let addr = ptr as usize;
        let size_bytes = self.local.config.buffer_size_bytes;
        let state = self.local.state.borrow();
        let (index, slot) = state
            .slots
            .iter()
            .enumerate()
            .find(|(_, slot)| addr >= slot.base_addr && addr - slot.base_addr < size_bytes)?;
        Some(BufferLocation {
            index: u32::try_from(index).ok()?,
            offset_bytes: addr - slot.base_addr,
        })
    }
}

impl BufferPool {
    /// Reads once into the unused tail of a buffer that other reads share,
    /// and returns the bytes read as a slice of it (empty: end of stream).
    ///
    /// A body piece of a streamed response is a few hundred bytes; read
    /// into a buffer of its own, it would hold
    /// [`buffer_size_bytes`](Self::buffer_size_bytes) (and at least one
    /// resident page) until the piece is written on, which may be long
    /// after the read when the way on is busy. Packed, consecutive reads
    /// on this core, from any connection, fill one buffer back to back:
    /// the kernel still writes into pooled memory and the pieces are
    /// still slices of it (no copy). The buffer goes home when the last
    /// piece cut from it is dropped, on any thread; a read that would find
    /// less than a quarter of a buffer left takes a fresh one. The pool
    /// being exhausted takes an overflow buffer, as
    /// [`acquire`](Self::acquire) does.
    ///
    /// `read` is a synchronous, non-blocking read (a `recv` with
    /// `MSG_DONTWAIT` after a readiness wait): it gets the tail and returns
    /// how many bytes it wrote at its start, or an error (then nothing is
    /// taken from the tail). A read that is still in flight when this
    /// returns (an io_uring operation) must not be given the tail.
    ///
    /// # Safety
    ///
    /// When `read` returns `Ok(n)`, it has initialized the first `n`
    /// bytes of the slice it was given, and holds no pointer into it
    /// after it returned.
    pub unsafe fn read_packed<F>(&self, read: F) -> std::io::Result<Bytes>
    where
        F: FnOnce(&mut [MaybeUninit<u8>]) -> std::io::Result<usize>,
    {
        let (memory, cursor_bytes) = self.packing_tail();
        // SAFETY: `cursor_bytes..` is covered by no piece (pieces end at or
        // before the cursor, which only moves forward), and only this core
        // writes to a packed buffer: the `Packing` record that allows it
        // lives in this core's `!Send` state, and `packing_tail` handed it
        // over. So this is the only reference to those bytes while `read`
        // runs.
        let tail = unsafe { memory.tail_mut(cursor_bytes) };
        let result = read(tail);
        let read_bytes = match result {
            Ok(read_bytes) => read_bytes.min(memory.len_bytes - cursor_bytes),
            Err(error) => {
                self.keep_packing(&memory, cursor_bytes);
                return Err(error);
            }
        };
        let end_bytes = cursor_bytes + read_bytes;
        self.keep_packing(&memory, end_bytes);
        if read_bytes == 0 {
            return Ok(Bytes::new());
        }
        Ok(Bytes::from_owner(PackedPiece {
            memory,
            start_bytes: cursor_bytes,
            end_bytes,
        }))
    }

    /// The packed buffer and cursor the next read goes to: the current one
    /// while a piece keeps it alive and enough of it is left, else a fresh
    /// buffer.
    fn packing_tail(&self) -> (Arc<PackedMemory>, usize) {
        let size_bytes = self.local.config.buffer_size_bytes;
        let room_min_bytes = (size_bytes / 4).max(1);
        let current = self.local.state.borrow_mut().packing.take();
        if let Some(packing) = current {
            if size_bytes - packing.cursor_bytes >= room_min_bytes {
                if let Some(memory) = packing.memory.upgrade() {
                    return (memory, packing.cursor_bytes);
                }
            }
        }
        let fresh = match self.local.take() {
            Some((id, memory)) => PackedMemory::new(
                memory,
                Some(ReturnPath {
                    id,
                    shared: Arc::clone(&self.local.shared),
                }),
            ),
            None => {
                let mut state = self.local.state.borrow_mut();
                state.overflow_allocations = state.overflow_allocations.saturating_add(1);
                drop(state);
                PackedMemory::new(fresh_memory(size_bytes), None)
            }
        };
        (Arc::new(fresh), 0)
    }

    fn keep_packing(&self, memory: &Arc<PackedMemory>, cursor_bytes: usize) {
        self.local.state.borrow_mut().packing = Some(Packing {
            memory: Arc::downgrade(memory),
            cursor_bytes,
        });
    }
}

impl Default for BufferPool {
    /// A new, empty pool with [`PoolConfig::default`] sizing (16 KiB
    /// buffers, at most 1024 pooled, allocated lazily).
    fn default() -> Self {
        Self::with_valid_config(PoolConfig::default())
    }
}

impl fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.local.state.borrow();
        f.debug_struct("BufferPool")
            .field("buffer_size_bytes", &self.local.config.buffer_size_bytes)
            .field("capacity_max", &self.local.config.buffer_count_max)
            .field("allocated", &state.slots.len())
            .field("free", &state.free.len())
            .field("overflow_allocations", &state.overflow_allocations)
            .field("stale_returns", &state.stale_returns)
            .finish()
    }
}

impl Local {
    /// Takes a buffer out of the slab, allocating a slot if none is free and
    /// the cap allows.
    fn take(&self) -> Option<(BufferId, Memory)> {
        let mut state = self.state.borrow_mut();
        let index = match state.free.pop() {
            Some(index) => index,
            None => {
                state.drain(self);
                match state.free.pop() {
                    Some(index) => index,
                    None => return state.allocate_slot(&self.config),
                }
            }
        };
        let slot = state.slots.get_mut(index as usize)?;
        let memory = slot.memory.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        let id = BufferId {
            index,
            generation: slot.generation,
        };
        Some((id, memory))
    }

    /// Brings memory home from a [`PooledBuf`] dropped on this core.
    fn give_back(&self, returned: Returned) {
        match self.state.try_borrow_mut() {
            Ok(mut state) => state.accept(returned, &self.config),
            // Re-entered while the slab is borrowed: defer through the queue.
            Err(_) => self.shared.push(returned),
        }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        let returned = {
            let mut queue = self.shared.lock();
            queue.pool_dropped = true;
            std::mem::take(&mut queue.returned)
        };
        // Freed outside the lock.
        drop(returned);
    }
}

impl State {
    /// Allocates a new slot and lends it at once, if the cap allows.
    fn allocate_slot(&mut self, config: &PoolConfig) -> Option<(BufferId, Memory)> {
        if self.slots.len() >= config.buffer_count_max {
            return None;
        }
        // buffer_count_max ≤ BUFFER_COUNT_MAX < u32::MAX, checked by validate().
        let index = u32::try_from(self.slots.len()).ok()?;
        let memory = fresh_memory(config.buffer_size_bytes);
        self.slots.push(Slot {
            generation: 0,
            memory: None,
            base_addr: memory.as_ptr() as usize,
        });
        let id = BufferId {
            index,
            generation: 0,
        };
        Some((id, memory))
    }

    /// Puts returned memory back into its slot, or counts it stale.
    fn accept(&mut self, returned: Returned, config: &PoolConfig) {
        let Returned { id, memory } = returned;
        let slot = self
            .slots
            .get_mut(id.index as usize)
            .filter(|slot| slot.memory.is_none() && slot.generation == id.generation)
            .filter(|_| memory.len() == config.buffer_size_bytes);
        match slot {
            Some(slot) => {
                slot.memory = Some(memory);
                self.free.push(id.index);
            }
            None => self.stale_returns = self.stale_returns.saturating_add(1),
        }
    }

    /// Moves everything in the cross-thread return queue into the slab.
    fn drain(&mut self, local: &Local) {
        let mut batch = std::mem::take(&mut self.spare);
        {
            let mut queue = local.shared.lock();
            if queue.returned.is_empty() {
                drop(queue);
                self.spare = batch;
                return;
            }
            std::mem::swap(&mut queue.returned, &mut batch);
        }
        for returned in batch.drain(..) {
            self.accept(returned, &local.config);
        }
        self.spare = batch;
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReturnQueue> {
        // The critical sections only push/swap vectors; a poisoned lock still
        // holds a consistent queue.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues memory for its pool, or frees it if the pool is gone.
    fn push(&self, returned: Returned) {
        let mut queue = self.lock();
        if queue.pool_dropped {
            drop(queue);
            drop(returned);
        } else {
            queue.returned.push(returned);
        }
    }
}

/// A buffer's memory; only its filled prefix is initialized.
type Memory = Box<[MaybeUninit<u8>]>;

/// Memory for one buffer, uninitialized: no page of it is touched until a
/// read or copy fills it.
fn fresh_memory(size_bytes: usize) -> Memory {
    Box::new_uninit_slice(size_bytes)
}

/// `memory[..len_bytes]` as bytes.
///
/// # Safety
///
/// `len_bytes <= memory.len()`, and every byte of that prefix was written
/// (copied in, or filled by a read and declared with `set_init`).
unsafe fn filled(memory: &[MaybeUninit<u8>], len_bytes: usize) -> &[u8] {
    let prefix = &memory[..len_bytes];
    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and the caller
    // guarantees the prefix is initialized.
    unsafe { &*(prefix as *const [MaybeUninit<u8>] as *const [u8]) }
}

/// `memory[..len_bytes]` as mutable bytes.
///
/// # Safety
///
/// As for [`filled`].
unsafe fn filled_mut(memory: &mut [MaybeUninit<u8>], len_bytes: usize) -> &mut [u8] {
    let prefix = &mut memory[..len_bytes];
    // SAFETY: as in `filled`; the borrow is exclusive.
    unsafe { &mut *(prefix as *mut [MaybeUninit<u8>] as *mut [u8]) }
}

/// Where a buffer's memory goes when it is dropped.
enum Origin {
    /// Lent by a pool; goes back to it if it still exists.
    Pooled {
        /// The loan.
        id: BufferId,
        /// The lending pool.
        home: Weak<Local>,
    },
    /// Allocated past the pool's cap; freed on drop.
    Overflow,
    /// Memory already handed on (after `freeze`); nothing to do.
    Detached,
}

/// A fixed-capacity IO buffer lent by a [`BufferPool`].
///
/// Pass it by value to monoio reads (`stream.read(buf)`): the read fills the
/// buffer from offset 0 up to its capacity and sets [`len`](Self::len) to
/// the bytes read; use `buf.slice_mut(buf.len()..)` to append instead.
/// [`freeze`](Self::freeze) turns the filled bytes into a `Bytes` without
/// copying. Dropping the buffer returns it to its pool, whenever that
/// happens — also late, after a cancelled io_uring read completes, and also
/// after the pool itself is gone (the memory is then freed).
///
/// `!Send`: it belongs to the core that acquired it.
pub struct PooledBuf {
    /// Owned outright while on loan; `len() == buffer_size_bytes`.
    memory: Memory,
    /// Initialized (filled) prefix; always `<= memory.len()`, and every
    /// byte of it written.
    len_bytes: usize,
    origin: Origin,
}

impl PooledBuf {
    /// Bytes filled so far.
    pub fn len(&self) -> usize {
        self.len_bytes
    }

    /// Whether nothing has been filled.
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    /// Total size of the buffer, in bytes.
    pub fn capacity_bytes(&self) -> usize {
        self.memory.len()
    }

    /// Bytes still free after [`len`](Self::len).
    pub fn remaining_bytes(&self) -> usize {
        self.memory.len() - self.len_bytes
    }

    /// The loan's id, or `None` for an overflow buffer.
    pub fn id(&self) -> Option<BufferId> {
        match self.origin {
            Origin::Pooled { id, .. } => Some(id),
            Origin::Overflow | Origin::Detached => None,
        }
    }

    /// Whether this buffer was allocated past the pool's cap.
    pub fn is_overflow(&self) -> bool {
        matches!(self.origin, Origin::Overflow)
    }

    /// Sets the length to 0.
    pub fn clear(&mut self) {
        self.len_bytes = 0;
    }

    /// Shortens the filled part to `len_bytes`; no effect if already shorter.
    pub fn truncate(&mut self, len_bytes: usize) {
        self.len_bytes = self.len_bytes.min(len_bytes);
    }

    /// Appends as much of `src` as fits; returns the number of bytes copied.
    pub fn extend_from_slice(&mut self, src: &[u8]) -> usize {
        let count = src.len().min(self.remaining_bytes());
        let end = self.len_bytes + count;
        for (dst, &byte) in self.memory[self.len_bytes..end].iter_mut().zip(src) {
            dst.write(byte);
        }
        self.len_bytes = end;
        count
    }

    /// Hands the filled bytes on as a `Bytes` that shares this memory
    /// without copying. Clones and slices of it may go to any thread; the
    /// memory returns to the pool when the last of them is dropped (or is
    /// freed if the pool is gone by then). An empty buffer returns to the
    /// pool at once and yields an empty `Bytes`.
    pub fn freeze(mut self) -> Bytes {
        if self.len_bytes == 0 {
            return Bytes::new();
        }
        let memory = std::mem::take(&mut self.memory);
        let len_bytes = self.len_bytes;
        let return_path = match std::mem::replace(&mut self.origin, Origin::Detached) {
            Origin::Pooled { id, home } => home.upgrade().map(|local| ReturnPath {
                id,
                shared: Arc::clone(&local.shared),
            }),
            Origin::Overflow | Origin::Detached => None,
        };
        Bytes::from_owner(FrozenBuf {
            memory,
            len_bytes,
            return_path,
        })
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Origin::Pooled { id, home } = std::mem::replace(&mut self.origin, Origin::Detached) {
            if let Some(local) = home.upgrade() {
                let memory = std::mem::take(&mut self.memory);
                local.give_back(Returned { id, memory });
            }
        }
    }
}

impl Deref for PooledBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `len_bytes <= memory.len()` and the prefix was written
        // (the invariant of `len_bytes`).
        unsafe { filled(&self.memory, self.len_bytes) }
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`.
        unsafe { filled_mut(&mut self.memory, self.len_bytes) }
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledBuf")
            .field("id", &self.id())
            .field("overflow", &self.is_overflow())
            .field("len_bytes", &self.len_bytes)
            .field("capacity_bytes", &self.memory.len())
            .finish()
    }
}

// SAFETY: `read_ptr` points at the heap allocation owned by `memory`. Moving a
// `PooledBuf` moves only the box pointer, never the allocation, and the box is
// neither reallocated nor replaced while the value lives (only `freeze`/`Drop`
// take it, consuming the buffer), so the address is stable as monoio requires.
// `bytes_init` is `len_bytes`, which is always `<= memory.len()`, and every byte
// of that prefix was written.
unsafe impl IoBuf for PooledBuf {
    fn read_ptr(&self) -> *const u8 {
        self.memory.as_ptr().cast()
    }

    fn bytes_init(&self) -> usize {
        self.len_bytes
    }
}

// SAFETY: `write_ptr` points at the same stable heap allocation as `read_ptr`
// (see above) and is valid for writes of `bytes_total` = `memory.len()` bytes,
// which this buffer owns exclusively.
unsafe impl IoBufMut for PooledBuf {
    fn write_ptr(&mut self) -> *mut u8 {
        self.memory.as_mut_ptr().cast()
    }

    fn bytes_total(&mut self) -> usize {
        self.memory.len()
    }

    unsafe fn set_init(&mut self, pos: usize) {
        // The caller guarantees the first `pos` bytes are written (the
        // prefix before a read's offset was, and the read filled the rest);
        // clamp to keep the `len_bytes <= memory.len()` invariant even if a
        // caller breaks the contract.
        self.len_bytes = pos.min(self.memory.len());
    }
}

/// How a frozen buffer finds its way home from any thread.
struct ReturnPath {
    id: BufferId,
    shared: Arc<Shared>,
}

/// The `Bytes` owner behind [`PooledBuf::freeze`]: `Send`, so the `Bytes`
/// may cross cores.
struct FrozenBuf {
    memory: Memory,
    /// The filled prefix of the buffer it was frozen from.
    len_bytes: usize,
    return_path: Option<ReturnPath>,
}

impl AsRef<[u8]> for FrozenBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len_bytes` is the filled prefix of the `PooledBuf` this
        // was frozen from (its invariant); nothing writes to it since.
        unsafe { filled(&self.memory, self.len_bytes) }
    }
}

impl Drop for FrozenBuf {
    fn drop(&mut self) {
        if let Some(ReturnPath { id, shared }) = self.return_path.take() {
            let memory = std::mem::take(&mut self.memory);
            shared.push(Returned { id, memory });
        }
    }
}

/// A pooled buffer that packed reads share ([`BufferPool::read_packed`]):
/// pieces read its filled front, this core's next read writes its tail.
/// Goes home (or is freed) when the last piece is dropped.
struct PackedMemory {
    /// The buffer's memory, from `Box::into_raw`; rebuilt into its box on
    /// drop.
    ptr: *mut MaybeUninit<u8>,
    len_bytes: usize,
    return_path: Option<ReturnPath>,
}

// SAFETY: the memory is owned (a leaked box, rebuilt once in `drop`).
// Pieces on any thread only read bytes that were written before the piece
// was made (and handed over to that thread by whatever carried the piece,
// which synchronizes) and are never written again; the one writer is the
// owning core, which only writes past every piece (see `read_packed`).
unsafe impl Send for PackedMemory {}
// SAFETY: as for `Send`: shared access only reads filled, frozen bytes.
unsafe impl Sync for PackedMemory {}

impl PackedMemory {
    fn new(memory: Memory, return_path: Option<ReturnPath>) -> Self {
        let len_bytes = memory.len();
        Self {
            ptr: Box::into_raw(memory).cast::<MaybeUninit<u8>>(),
            len_bytes,
            return_path,
        }
    }

    /// The bytes from `start_bytes` to the end, for a read to fill.
    ///
    /// # Safety
    ///
    /// No piece covers `start_bytes..`, and nothing else holds a reference
    /// into it while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn tail_mut(&self, start_bytes: usize) -> &mut [MaybeUninit<u8>] {
        let start_bytes = start_bytes.min(self.len_bytes);
        // SAFETY: in bounds of the allocation (`start_bytes <= len_bytes`);
        // exclusive by the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.add(start_bytes), self.len_bytes - start_bytes)
        }
    }
}

impl Drop for PackedMemory {
    fn drop(&mut self) {
        let raw = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len_bytes);
        // SAFETY: `ptr` and `len_bytes` came from `Box::into_raw` of a box
        // of this length, and this is the only place that rebuilds it.
        let memory: Memory = unsafe { Box::from_raw(raw) };
        match self.return_path.take() {
            Some(ReturnPath { id, shared }) => shared.push(Returned { id, memory }),
            None => drop(memory),
        }
    }
}

/// One packed read: the `Bytes` owner of `start_bytes..end_bytes`.
struct PackedPiece {
    memory: Arc<PackedMemory>,
    start_bytes: usize,
    end_bytes: usize,
}

impl AsRef<[u8]> for PackedPiece {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `read_packed` made this piece from bytes its read had
        // just initialized, inside the allocation; nothing writes them
        // again (the cursor moved past them).
        unsafe {
            std::slice::from_raw_parts(
                self.memory.ptr.add(self.start_bytes).cast::<u8>(),
                self.end_bytes - self.start_bytes,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_pool(count: usize) -> BufferPool {
        match BufferPool::new(PoolConfig {
            buffer_size_bytes: 64,
            buffer_count_max: count,
        }) {
            Ok(pool) => pool,
            Err(error) => panic!("valid config rejected: {error}"),
        }
    }

    #[test]
    fn stale_return_is_counted_and_never_pooled() {
        let pool = small_pool(2);
        let buf = pool.try_acquire();
        let id = buf.as_ref().and_then(PooledBuf::id);
        assert_eq!(
            id,
            Some(BufferId {
                index: 0,
                generation: 0
            })
        );
        drop(buf);
        assert_eq!(pool.available(), 1);

        // Returns that name a slot at home, a wrong generation or an unknown
        // index: each is detected and its memory dropped.
        let forged = [
            BufferId {
                index: 0,
                generation: 0,
            },
            BufferId {
                index: 0,
                generation: 7,
            },
            BufferId {
                index: 9,
                generation: 0,
            },
        ];
        for id in forged {
            pool.local.give_back(Returned {
                id,
                memory: fresh_memory(64),
            });
        }
        assert_eq!(pool.stale_returns(), 3);
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.allocated(), 1);

        // A slot on loan, right generation, wrong size: still rejected.
        let held = pool.try_acquire();
        let held_id = held.as_ref().and_then(PooledBuf::id);
        assert_eq!(
            held_id,
            Some(BufferId {
                index: 0,
                generation: 1
            })
        );
        if let Some(id) = held_id {
            pool.local.shared.push(Returned {
                id,
                memory: fresh_memory(32),
            });
        }
        assert_eq!(pool.stale_returns(), 4);
        assert_eq!(pool.in_use(), 1);

        // The genuine return is still accepted exactly once.
        drop(held);
        assert_eq!(pool.available(), 1);
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.stale_returns(), 4);
    }

    #[test]
    fn stats_and_locate_follow_loans_and_frozen_slices() {
        let pool = small_pool(2);
        assert_eq!(
            pool.stats(),
            PoolStats {
                capacity_max: 2,
                ..PoolStats::default()
            }
        );
        let mut first = pool.acquire();
        first.extend_from_slice(b"0123456789");
        let frozen = first.freeze();
        let second = pool.acquire();
        let spill = pool.acquire();
        assert!(spill.is_overflow());
        assert_eq!(
            pool.stats(),
            PoolStats {
                in_use: 2,
                available: 0,
                allocated: 2,
                capacity_max: 2,
                overflow_allocations: 1,
                stale_returns: 0,
            }
        );

        // A slice of a frozen buffer is found at its offset; memory the
        // pool never lent (overflow, heap) is not.
        let tail = Bytes::slice(&frozen, 4..);
        assert_eq!(
            pool.locate(tail.as_ptr()),
            Some(BufferLocation {
                index: 0,
                offset_bytes: 4
            })
        );
        assert_eq!(
            pool.locate(second.as_ptr()),
            Some(BufferLocation {
                index: 1,
                offset_bytes: 0
            })
        );
        assert_eq!(pool.locate(spill.as_ptr()), None);
        let heap = Bytes::copy_from_slice(&tail);
        assert_eq!(pool.locate(heap.as_ptr()), None);

        // Dropped on another thread, the last slice still comes home.
        drop(frozen);
        let joined = std::thread::spawn(move || drop(tail)).join();
        assert!(joined.is_ok());
        drop(second);
        drop(spill);
        assert_eq!(
            pool.stats(),
            PoolStats {
                in_use: 0,
                available: 2,
                allocated: 2,
                capacity_max: 2,
                overflow_allocations: 1,
                stale_returns: 0,
            }
        );
    }

    #[test]
    fn default_pool_uses_the_default_config() {
        let pool = BufferPool::default();
        assert_eq!(pool.config(), PoolConfig::default());
        assert_eq!(PoolConfig::default().validate(), Ok(()));
        assert_eq!(pool.buffer_size_bytes(), 16 * 1024);
        assert_eq!(pool.capacity_max(), 1024);
        assert_eq!(pool.allocated(), 0);
    }

    /// A packed read that copies `src` (as much as fits) into the tail it
    /// is given, and records how long that tail was.
    fn packed(pool: &BufferPool, src: &[u8], tail_seen: &mut usize) -> std::io::Result<Bytes> {
        let read = |tail: &mut [MaybeUninit<u8>]| {
            *tail_seen = tail.len();
            let count = src.len().min(tail.len());
            for (dst, &byte) in tail.iter_mut().zip(&src[..count]) {
                dst.write(byte);
            }
            Ok(count)
        };
        // SAFETY: `read` initializes exactly the bytes it reports.
        unsafe { pool.read_packed(read) }
    }

    fn at(index: u32, offset_bytes: usize) -> Option<BufferLocation> {
        Some(BufferLocation {
            index,
            offset_bytes,
        })
    }

    #[test]
    fn packed_reads_fill_one_buffer_back_to_back_and_it_goes_home_with_the_last_piece() {
        let pool = small_pool(2);
        let mut tail = 0;
        let hello = packed(&pool, b"hello", &mut tail).unwrap();
        assert_eq!((&hello[..], tail), (&b"hello"[..], 64));
        let world = packed(&pool, b" world", &mut tail).unwrap();
        assert_eq!((&world[..], tail), (&b" world"[..], 59));
        // Both are slices of one pooled buffer, the second right after the
        // first: no copy, one buffer on loan.
        assert_eq!(pool.locate(hello.as_ptr()), at(0, 0));
        assert_eq!(pool.locate(world.as_ptr()), at(0, 5));
        assert_eq!(pool.in_use(), 1);
        // A clone and a slice keep the buffer too; it goes home with the
        // last of them.
        let tail_of_world = Bytes::slice(&world, 1..);
        drop(world);
        drop(hello);
        assert_eq!(pool.in_use(), 1);
        assert_eq!(&tail_of_world[..], b"world");
        drop(tail_of_world);
        assert_eq!(pool.stats().in_use, 0);
        assert_eq!(pool.available(), 1);
        // With no piece left, the next read starts a buffer afresh (the
        // same one, back from home) at its start.
        let again = packed(&pool, b"again", &mut tail).unwrap();
        assert_eq!((pool.locate(again.as_ptr()), tail), (at(0, 0), 64));
        assert_eq!((pool.allocated(), pool.stale_returns()), (1, 0));
    }

    #[test]
    fn a_packed_read_that_would_find_less_than_a_quarter_left_takes_a_fresh_buffer() {
        let pool = small_pool(2);
        let mut tail = 0;
        let first = packed(&pool, &[b'a'; 44], &mut tail).unwrap();
        // 20 bytes left: more than a quarter of 64, so the read goes there,
        // and the kernel may fill all of it.
        let second = packed(&pool, &[b'b'; 30], &mut tail).unwrap();
        assert_eq!((second.len(), tail), (20, 20));
        assert_eq!(pool.locate(second.as_ptr()), at(0, 44));
        // Nothing left: a fresh buffer, from its start.
        let third = packed(&pool, b"c", &mut tail).unwrap();
        assert_eq!((pool.locate(third.as_ptr()), tail), (at(1, 0), 64));
        assert_eq!(pool.in_use(), 2);
        assert_eq!(&first[..], &[b'a'; 44][..]);
        assert_eq!(&second[..], &[b'b'; 20][..]);
        drop((first, second));
        assert_eq!(pool.in_use(), 1);
        drop(third);
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn a_failed_or_empty_packed_read_takes_nothing_from_the_tail() {
        let pool = small_pool(1);
        let mut tail = 0;
        let first = packed(&pool, b"abc", &mut tail).unwrap();
        // SAFETY: the read reports an error and initializes nothing.
        let failed = unsafe { pool.read_packed(|_| Err(std::io::ErrorKind::WouldBlock.into())) };
        assert_eq!(
            failed.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::WouldBlock)
        );
        let end_of_stream = packed(&pool, b"", &mut tail).unwrap();
        assert!(end_of_stream.is_empty());
        let next = packed(&pool, b"de", &mut tail).unwrap();
        assert_eq!((pool.locate(next.as_ptr()), tail), (at(0, 3), 61));
        assert_eq!((&first[..], &next[..]), (&b"abc"[..], &b"de"[..]));
        assert_eq!(pool.in_use(), 1);
    }

    #[test]
    fn packed_pieces_dropped_on_another_thread_go_home() {
        let pool = small_pool(1);
        let mut tail = 0;
        let pieces = [
            packed(&pool, b"one", &mut tail).unwrap(),
            packed(&pool, b"two", &mut tail).unwrap(),
        ];
        let joined = std::thread::spawn(move || pieces.concat()).join();
        assert_eq!(joined.ok().as_deref(), Some(&b"onetwo"[..]));
        assert_eq!(pool.in_use(), 0);
        assert_eq!((pool.available(), pool.stale_returns()), (1, 0));
    }

    #[test]
    fn an_exhausted_pool_packs_into_an_overflow_buffer_that_is_freed() {
        let pool = small_pool(1);
        let held = pool.try_acquire();
        assert!(held.is_some());
        let mut tail = 0;
        let piece = packed(&pool, b"spill", &mut tail).unwrap();
        assert_eq!((&piece[..], tail), (&b"spill"[..], 64));
        assert_eq!(pool.locate(piece.as_ptr()), None);
        assert_eq!(pool.overflow_allocations(), 1);
        drop((piece, held));
        assert_eq!(
            (pool.in_use(), pool.available(), pool.allocated()),
            (0, 1, 1)
        );
        assert_eq!(pool.stale_returns(), 0);
    }
}
