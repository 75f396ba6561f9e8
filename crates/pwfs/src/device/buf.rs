//! Owned, aligned I/O buffers.
//!
//! Every buffer handed to a [`Device`](super::Device) is an [`AlignedBuf`]: memory
//! aligned to [`MEM_ALIGN`] (so that O_DIRECT accepts it) and owned, so that an engine
//! can keep it while the device works and hand it back with the result, even on error.
//!
//! Buffers come from the heap or from an [`Arena`]: one mapping carved into
//! block-sized slots, which the io_uring engine registers once per ring as a fixed
//! buffer (the user-space analogue of a pre-DMA-mapped page pool). A slot returns to
//! its arena when its buffer is dropped.

use parking_lot::Mutex;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

/// Alignment of buffer memory. 4 KiB satisfies O_DIRECT on every device we target.
pub const MEM_ALIGN: usize = 4096;

pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    origin: Origin,
}

enum Origin {
    Heap { cap: usize },
    Arena { arena: Arc<Arena>, slot: u32 },
}

// SAFETY: the buffer owns its memory exclusively; the arena slot is never handed out twice.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed heap buffer of `len` bytes.
    pub fn new(len: usize) -> AlignedBuf {
        let cap = len.max(1).next_multiple_of(MEM_ALIGN);
        let layout = Layout::from_size_align(cap, MEM_ALIGN).expect("buffer layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len, origin: Origin::Heap { cap } }
    }

    pub fn from_slice(data: &[u8]) -> AlignedBuf {
        let mut b = AlignedBuf::new(data.len());
        b.copy_from_slice(data);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The arena this buffer lives in, if any (the io_uring engine uses fixed I/O then).
    pub fn arena(&self) -> Option<&Arc<Arena>> {
        match &self.origin {
            Origin::Arena { arena, .. } => Some(arena),
            Origin::Heap { .. } => None,
        }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match &self.origin {
            Origin::Heap { cap } => {
                let layout = Layout::from_size_align(*cap, MEM_ALIGN).expect("buffer layout");
                // SAFETY: allocated in `new` with this layout.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
            }
            Origin::Arena { arena, slot } => arena.free.lock().put(*slot),
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// One anonymous mapping carved into `slot_size` slots.
pub struct Arena {
    base: NonNull<u8>,
    slot_size: usize,
    slots: usize,
    free: Mutex<Slots>,
}

/// Free slots as a bitmap, handed out next-fit in address order: buffers taken one
/// after another are adjacent in memory whenever possible, and (with huge pages under
/// the arena) physically contiguous, so the block layer sends a run of pages as a few
/// large segments rather than one segment per page.
struct Slots {
    free: Vec<u64>,
    count: usize,
    cursor: usize,
}

impl Slots {
    fn new(n: usize) -> Slots {
        let mut free = vec![!0u64; n.div_ceil(64)];
        if !n.is_multiple_of(64) {
            *free.last_mut().expect("n > 0") = (1u64 << (n % 64)) - 1;
        }
        Slots { free, count: n, cursor: 0 }
    }

    fn take(&mut self) -> Option<u32> {
        if self.count == 0 {
            return None;
        }
        let words = self.free.len();
        let start = self.cursor / 64;
        for k in 0..=words {
            let w = (start + k) % words;
            let mut bits = self.free[w];
            if k == 0 {
                bits &= !0u64 << (self.cursor % 64);
            }
            if bits != 0 {
                let slot = w * 64 + bits.trailing_zeros() as usize;
                self.free[w] &= !(1u64 << (slot % 64));
                self.count -= 1;
                self.cursor = slot + 1;
                return Some(slot as u32);
            }
        }
        None
    }

    fn put(&mut self, slot: u32) {
        let s = slot as usize;
        debug_assert!(self.free[s / 64] & (1 << (s % 64)) == 0, "slot {s} freed twice");
        self.free[s / 64] |= 1 << (s % 64);
        self.count += 1;
    }
}

// SAFETY: the mapping lives as long as the arena; slots are handed out exclusively.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    pub fn new(slot_size: usize, slots: usize) -> std::io::Result<Arc<Arena>> {
        assert!(slot_size.is_multiple_of(MEM_ALIGN) && slots > 0);
        let bytes = slot_size * slots;
        // SAFETY: plain anonymous mapping; checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // Huge pages where the system allows them on request: fewer pages to pin when
        // a ring registers the arena, and physically contiguous runs of slots.
        // SAFETY: advice on a mapping we own; failure only means small pages.
        unsafe { libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE) };
        let free = Slots::new(slots);
        Ok(Arc::new(Arena {
            base: NonNull::new(ptr as *mut u8).expect("mmap returned null"),
            slot_size,
            slots,
            free: Mutex::new(free),
        }))
    }

    /// A slot buffer of `len <= slot_size` bytes (contents left over from its last
    /// use), or None when the arena is empty.
    pub fn alloc(self: &Arc<Arena>, len: usize) -> Option<AlignedBuf> {
        if len > self.slot_size {
            return None;
        }
        let slot = self.free.lock().take()?;
        // SAFETY: slot < slots, so the range lies inside the mapping.
        let ptr = unsafe { self.base.as_ptr().add(slot as usize * self.slot_size) };
        Some(AlignedBuf {
            ptr: NonNull::new(ptr).expect("slot pointer"),
            len,
            origin: Origin::Arena { arena: self.clone(), slot },
        })
    }

    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn bytes(&self) -> usize {
        self.slot_size * self.slots
    }

    pub fn free_slots(&self) -> usize {
        self.free.lock().count
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: unmapping what `new` mapped; no buffer outlives the arena (they hold an Arc).
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.bytes()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_hands_out_slots_in_address_order_and_reuses_them() {
        let a = Arena::new(4096, 100).unwrap();
        let bufs: Vec<AlignedBuf> = (0..100).map(|_| a.alloc(4096).unwrap()).collect();
        for w in bufs.windows(2) {
            assert_eq!(w[1].as_ptr() as usize - w[0].as_ptr() as usize, 4096, "adjacent");
        }
        assert!(a.alloc(4096).is_none(), "exhausted");
        assert!(a.alloc(8192).is_none(), "larger than a slot");
        let keep: Vec<AlignedBuf> = bufs.into_iter().enumerate().filter(|(i, _)| i % 2 == 0).map(|(_, b)| b).collect();
        assert_eq!(a.free_slots(), 50);
        let again: Vec<AlignedBuf> = (0..50).map(|_| a.alloc(512).unwrap()).collect();
        assert_eq!(a.free_slots(), 0);
        drop((keep, again));
        assert_eq!(a.free_slots(), 100);
    }
}
