//! tx: the running transaction's bookkeeping — which metadata blocks it has changed,
//! which blocks it revokes, which inodes it will store, and how large it can grow —
//! under a lock of its own, so that the data path (which changes an inode's size and
//! times but never the namespace or the allocators) does not take the metadata lock.
//!
//! Its size is counted as distinct blocks, and as an upper bound of what closing it may
//! still add: the extent chains of its inodes, the bitmap blocks that write-back of
//! reserved pages changes, and the room promised to operations that have been admitted
//! but have not made their changes yet (credits). Operations are admitted only while
//! that bound, with what they add, fits the journal (`commit`).
//!
//! Lock order: metadata → inode state → tx.

use crate::format as f;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

/// The size of a transaction: block images and revoke records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TxSize {
    pub images: u64,
    pub revokes: u64,
}

impl TxSize {
    pub const fn new(images: u64, revokes: u64) -> TxSize {
        TxSize { images, revokes }
    }

    /// Log blocks a transaction of this size takes: descriptors, images, commit block.
    pub fn log_blocks(self) -> u64 {
        (self.images + self.revokes).div_ceil(f::JDESC_ENTRIES as u64).max(1) + self.images + 1
    }

    pub fn plus(self, o: TxSize) -> TxSize {
        TxSize { images: self.images + o.images, revokes: self.revokes + o.revokes }
    }

    pub fn minus(self, o: TxSize) -> TxSize {
        TxSize { images: self.images - o.images, revokes: self.revokes - o.revokes }
    }
}

#[derive(Default)]
struct State {
    /// Metadata blocks changed (inode table blocks join when an inode registers).
    blocks: BTreeSet<u64>,
    revokes: BTreeSet<u64>,
    /// Registered inodes: their table block and what storing their extent chain may add.
    inodes: HashMap<u64, (u64, TxSize), std::hash::BuildHasherDefault<crate::fs::inode::InoHasher>>,
    chains: TxSize,
    /// The chains of the inodes a closing transaction is storing, counted until their
    /// blocks are taken (`take_blocks`).
    closing: TxSize,
    /// Pages reserved for delayed allocation, file-system wide.
    reserved: u64,
    credits: TxSize,
}

pub struct Tx {
    state: Mutex<State>,
    /// Which transaction is running: an inode registered in it carries this number.
    epoch: AtomicU64,
    /// The size bound in log blocks, for the commit-early check without the lock.
    estimate: AtomicU64,
    /// Block-bitmap blocks of the file system (write-back of reserved pages changes at
    /// most this many).
    bitmap_blocks: u64,
}

impl State {
    fn size(&self, bitmap_blocks: u64) -> TxSize {
        TxSize::new(self.blocks.len() as u64, self.revokes.len() as u64)
            .plus(self.chains)
            .plus(TxSize::new(self.reserved.min(bitmap_blocks), 0))
            .plus(self.credits)
            .plus(self.closing)
    }
}

/// What `close` hands to the commit: the inodes to store and the bound they were
/// counted under.
pub struct Closing {
    pub epoch: u64,
    pub inodes: Vec<(u64, TxSize)>,
}

impl Tx {
    pub fn new(bitmap_blocks: u64) -> Tx {
        // Room for many inodes from the start: the entries of inodes that threads in
        // different directories register and forget at every create and delete then
        // sit in cache lines of their own (in a small table they shared lines, which
        // passed between the CPUs at every operation).
        let state = State { inodes: HashMap::with_capacity_and_hasher(1024, Default::default()), ..Default::default() };
        Tx { state: Mutex::new(state), epoch: AtomicU64::new(1), estimate: AtomicU64::new(1), bitmap_blocks }
    }

    fn publish(&self, s: &State) {
        // Stored only when it moves: every reader's copy of the line stays valid.
        let v = s.size(self.bitmap_blocks).log_blocks();
        if self.estimate.load(Ordering::Relaxed) != v {
            self.estimate.store(v, Ordering::Relaxed);
        }
    }

    pub fn bitmap_blocks(&self) -> u64 {
        self.bitmap_blocks
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The size bound of the running transaction.
    pub fn size(&self) -> TxSize {
        self.state.lock().size(self.bitmap_blocks)
    }

    /// The bound in log blocks as last published (no lock; may lag by an operation).
    pub fn estimate(&self) -> u64 {
        self.estimate.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        let s = self.state.lock();
        s.blocks.is_empty() && s.revokes.is_empty() && s.inodes.is_empty()
    }

    /// A metadata block changed.
    pub fn block(&self, b: u64) {
        let mut s = self.state.lock();
        s.revokes.remove(&b);
        if s.blocks.insert(b) {
            self.publish(&s);
        }
    }

    /// A journaled block was freed: its image is dropped and a revoke recorded. Called
    /// through `Meta::revoke` (and this block's `Meta::in_tx` mark with it).
    pub(super) fn revoke(&self, b: u64) {
        let mut s = self.state.lock();
        s.blocks.remove(&b);
        s.revokes.insert(b);
        self.publish(&s);
    }

    /// Register inode `ino` (stored in table block `block`) with the running
    /// transaction, or update what its extent chain may add; returns the epoch it is
    /// registered in. With `room`, only if the transaction then still fits `room` log
    /// blocks (the data path's admission); None if it does not.
    pub fn register(&self, ino: u64, block: u64, chain: TxSize, room: Option<u64>) -> Option<u64> {
        let mut s = self.state.lock();
        if let Some(room) = room {
            let mut grown = s.size(self.bitmap_blocks);
            if !s.blocks.contains(&block) {
                grown.images += 1;
            }
            let old = s.inodes.get(&ino).map(|e| e.1).unwrap_or_default();
            let grown = grown.plus(chain).minus(old.min_of(chain));
            if grown.log_blocks() > room {
                return None;
            }
        }
        s.revokes.remove(&block);
        s.blocks.insert(block);
        let old = s.inodes.insert(ino, (block, chain)).map(|e| e.1).unwrap_or_default();
        s.chains = s.chains.minus(old).plus(chain);
        self.publish(&s);
        Some(self.epoch())
    }

    /// The inode was freed: nothing of it is stored any more (its table block, with
    /// the slot cleared, stays in the transaction).
    pub fn forget(&self, ino: u64) {
        let mut s = self.state.lock();
        if let Some((_, old)) = s.inodes.remove(&ino) {
            s.chains = s.chains.minus(old);
            self.publish(&s);
        }
    }

    pub fn set_reserved(&self, pages: u64) {
        let mut s = self.state.lock();
        s.reserved = pages;
        self.publish(&s);
    }

    /// Promise `size` to an operation if the transaction, with it, still fits `room`
    /// log blocks (checked and promised under one lock).
    pub fn try_credit(&self, size: TxSize, room: u64) -> bool {
        let mut s = self.state.lock();
        if s.size(self.bitmap_blocks).plus(size).log_blocks() > room {
            return false;
        }
        s.credits = s.credits.plus(size);
        self.publish(&s);
        true
    }

    pub fn release(&self, size: TxSize) {
        let mut s = self.state.lock();
        s.credits = s.credits.minus(size);
        self.publish(&s);
    }

    pub fn credits(&self) -> TxSize {
        self.state.lock().credits
    }

    /// Close the registration of inodes: a new epoch starts, and the inodes registered
    /// in the one that ends are the commit's to store (it registers again those that
    /// must stay: a writer in the middle of a write, pages still reserved).
    pub fn close_inodes(&self) -> Closing {
        let mut s = self.state.lock();
        let epoch = self.epoch.fetch_add(1, Ordering::AcqRel);
        let inodes: Vec<(u64, TxSize)> = s.inodes.drain().map(|(ino, (_, chain))| (ino, chain)).collect();
        s.closing = std::mem::take(&mut s.chains);
        self.publish(&s);
        Closing { epoch, inodes }
    }

    /// Take the changed blocks and revokes (after the inodes are stored).
    pub fn take_blocks(&self) -> (BTreeSet<u64>, BTreeSet<u64>) {
        let mut s = self.state.lock();
        let out = (std::mem::take(&mut s.blocks), std::mem::take(&mut s.revokes));
        s.closing = TxSize::default();
        // Inodes registered meanwhile (in the new transaction, or kept there) have
        // their table block in it still: it was taken with this one's blocks.
        let kept: Vec<u64> = s.inodes.values().map(|e| e.0).collect();
        s.blocks.extend(kept);
        self.publish(&s);
        out
    }

    /// The blocks of the running transaction, for the metadata cache's shrinking.
    pub fn blocks(&self) -> BTreeSet<u64> {
        self.state.lock().blocks.clone()
    }
}

impl TxSize {
    /// Field-wise minimum (what of an old estimate a new one replaces).
    fn min_of(self, o: TxSize) -> TxSize {
        TxSize::new(self.images.min(o.images), self.revokes.min(o.revokes))
    }
}

/// Room promised in the running transaction (or the next, if it commits meanwhile) to
/// an admitted operation, until its changes are made and this is dropped. It borrows
/// the transaction: a reference count of the shared `Tx` changed by every operation
/// would pass that cache line between the CPUs of two creators.
pub struct Credit<'a> {
    tx: &'a Tx,
    size: TxSize,
}

impl<'a> Credit<'a> {
    /// Promise `size` if the transaction still fits `room` with it.
    pub fn try_new(tx: &'a Tx, size: TxSize, room: u64) -> Option<Credit<'a>> {
        // Built only when promised: a dropped `Credit` gives its room back.
        tx.try_credit(size, room).then(|| Credit { tx, size })
    }
}

impl Drop for Credit<'_> {
    fn drop(&mut self) {
        self.tx.release(self.size);
    }
}
