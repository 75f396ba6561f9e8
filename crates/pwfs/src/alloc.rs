//! alloc: which data blocks are free.
//!
//! Interface: an in-memory bitset of the data area, rebuilt from the on-disk block
//! bitmap at mount. `alloc` hands out a contiguous run near a goal (delayed allocation
//! asks for whole runs at write-back); `free` does not make blocks reusable at once:
//! they stay taken until the transaction that freed them has committed
//! (`take_pending`, then `release`), so that a crash can never leave an old inode pointing at a
//! block that already holds someone else's data. The caller mirrors every change into
//! the on-disk bitmap through the journal.

pub struct Allocator {
    /// First block number this allocator manages.
    base: u64,
    len: u64,
    words: Vec<u64>,
    free: u64,
    /// Freed in the running transaction; still marked used until it commits.
    pending: Vec<(u64, u64)>,
    /// Freed blocks taken by a commit in flight (`take_pending`) and not yet given
    /// back (`release`): free soon, like `pending`.
    committing: u64,
    hint: u64,
}

impl Allocator {
    /// An allocator for blocks `base..base+len`, all free.
    pub fn new(base: u64, len: u64) -> Allocator {
        Allocator {
            base,
            len,
            words: vec![0; len.div_ceil(64) as usize],
            free: len,
            pending: Vec::new(),
            committing: 0,
            hint: 0,
        }
    }

    pub fn free_blocks(&self) -> u64 {
        self.free
    }

    /// Blocks freed and not reusable yet: by the running transaction, or by the one
    /// committing now (an operation short of space waits for that commit rather than
    /// fail: its frees come back when it is durable).
    pub fn pending_blocks(&self) -> u64 {
        self.pending.iter().map(|p| p.1).sum::<u64>() + self.committing
    }

    fn get(&self, i: u64) -> bool {
        self.words[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    fn set(&mut self, i: u64, v: bool) {
        let w = &mut self.words[(i / 64) as usize];
        if v {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }

    /// Mark a block used while loading the on-disk bitmap.
    pub fn mark_used(&mut self, block: u64) {
        let i = block - self.base;
        if !self.get(i) {
            self.set(i, true);
            self.free -= 1;
        }
    }

    /// Allocate up to `want` contiguous blocks, preferring to start at `goal`.
    /// Returns (first block, count), count >= 1, or None when the area is full.
    pub fn alloc(&mut self, want: u64, goal: Option<u64>) -> Option<(u64, u64)> {
        if self.free == 0 || want == 0 {
            return None;
        }
        let start = match goal {
            Some(g) if g >= self.base && g < self.base + self.len => g - self.base,
            _ => self.hint,
        };
        let first = self.find_free(start).or_else(|| self.find_free(0))?;
        let mut n = 0;
        while n < want && first + n < self.len && !self.get(first + n) {
            self.set(first + n, true);
            n += 1;
        }
        self.free -= n;
        self.hint = (first + n) % self.len;
        Some((self.base + first, n))
    }

    fn find_free(&self, from: u64) -> Option<u64> {
        let mut w = (from / 64) as usize;
        let mut mask = !0u64 << (from % 64);
        while w < self.words.len() {
            let avail = !self.words[w] & mask;
            if avail != 0 {
                let i = w as u64 * 64 + avail.trailing_zeros() as u64;
                return (i < self.len).then_some(i);
            }
            w += 1;
            mask = !0;
        }
        None
    }

    /// Whether every block of the run is inside the data area and in use (what `free`
    /// asserts; a damaged image can say otherwise).
    pub fn all_used(&self, block: u64, count: u64) -> bool {
        block >= self.base
            && block.checked_add(count).is_some_and(|end| end <= self.base + self.len)
            && (block..block + count).all(|b| self.get(b - self.base))
    }

    /// Free a run; it becomes allocatable after `release_pending`.
    pub fn free(&mut self, block: u64, count: u64) {
        assert!(block >= self.base && block + count <= self.base + self.len, "free of a block outside the data area");
        for b in block..block + count {
            debug_assert!(self.get(b - self.base), "double free of block {b}");
        }
        self.pending.push((block, count));
    }

    /// Hand the pending runs to the transaction being committed.
    pub fn take_pending(&mut self) -> Vec<(u64, u64)> {
        let runs = std::mem::take(&mut self.pending);
        self.committing += runs.iter().map(|r| r.1).sum::<u64>();
        runs
    }

    /// The transaction that freed these runs has committed: reuse them.
    pub fn release(&mut self, runs: Vec<(u64, u64)>) {
        for (block, count) in runs {
            for b in block..block + count {
                self.set(b - self.base, false);
            }
            self.free += count;
            self.committing = self.committing.saturating_sub(count);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_runs_and_delayed_reuse() {
        let mut a = Allocator::new(100, 200);
        assert_eq!(a.alloc(50, None), Some((100, 50)));
        assert_eq!(a.alloc(10, Some(120)), Some((150, 10)), "goal inside a used run moves on");
        a.free(110, 5);
        assert_eq!(a.free_blocks(), 140);
        assert_eq!(a.alloc(5, Some(110)), Some((160, 5)), "freed blocks are not reused before commit");
        let p = a.take_pending();
        a.release(p);
        assert_eq!(a.alloc(5, Some(110)), Some((110, 5)));
        assert_eq!(a.alloc(1000, None), Some((165, 135)), "a run stops at the end of the area");
        assert_eq!(a.free_blocks(), 0);
        a.free(120, 10);
        a.free(200, 7);
        let p = a.take_pending();
        a.release(p);
        let mut total = 0;
        while let Some((_, n)) = a.alloc(4, None) {
            total += n;
        }
        assert_eq!(total, 17, "every freed block is found again, around the end of the area");
        assert_eq!(a.alloc(1, None), None);
    }

    #[test]
    fn a_free_block_is_not_in_use() {
        let mut a = Allocator::new(10, 64);
        assert!(!a.all_used(13, 1), "nothing allocated yet");
        let (b, n) = a.alloc(4, None).unwrap();
        assert!(a.all_used(b, n));
        assert!(!a.all_used(b, n + 1), "one past the run is free");
        assert!(!a.all_used(5, 1) && !a.all_used(70, 10) && !a.all_used(u64::MAX, 2), "outside the area");
        a.free(b, n);
        let p = a.take_pending();
        a.release(p);
        assert!(!a.all_used(b, 1), "freed and released: no second free");
    }
}
