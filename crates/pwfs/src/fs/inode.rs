//! inode: an inode in memory, each with its own state lock and file-access lock, in a
//! sharded table that the data path reaches without the metadata lock.
//!
//! An inode's state (size, times, extents, reservations, everything of its on-disk
//! form) lives in its cell under the cell's mutex. The namespace and allocators stay
//! under the metadata lock; a read, or a write within allocated blocks, takes only the
//! inode's locks (and the transaction's, the first time the inode changes in a
//! transaction). Changes join the running transaction by registering the inode with
//! `Tx` (`InodeGuard::register`); the commit stores registered inodes into their table
//! blocks.
//!
//! Lock order (the whole engine, DESIGN's layers top down): file access (`io`) →
//! commit → metadata → inode state → tx → page → cache shard. Holding the state of one
//! inode while locking it again deadlocks; debug builds check every acquisition and
//! panic instead, naming the inode. A directory's name index (`InodeCell::names`) is a
//! leaf: taken under any of these, or alone by a lookup, and nothing is locked under it.

use super::tx::{Tx, TxSize};
use crate::format::{self as f, DiskInode};
use crate::lock::FileLock;
use crate::readahead::RaState;
use crossbeam_utils::CachePadded;
use parking_lot::lock_api::RawMutex as _;
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A run of file blocks mapped to device blocks (the value of `Inode::extents`, keyed
/// by its first file block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub len: u32,
    /// First device block.
    pub phys: u64,
    /// Allocated but never written (fallocate): reads as zeros, and becomes written
    /// when write-back first writes a page of it (ext4's unwritten extents).
    pub unwritten: bool,
}

/// An inode in memory. Extents map file block → run.
#[derive(Debug, Clone, Default)]
pub struct Inode {
    pub d: DiskInode,
    pub extents: BTreeMap<u32, Run>,
    /// Blocks of the on-disk extent chain, in order.
    pub chain: Vec<u64>,
    /// Blocks its extended attributes take (0 without any).
    pub xattr_blocks: u64,
    /// Pages with space reserved for delayed allocation (written, not yet mapped).
    pub reserved: BTreeSet<u64>,
    /// Pages written into unwritten blocks, not yet written back: write-back marks
    /// their blocks written, which may split a run in two (room for that is promised
    /// when the write is admitted, as for `reserved`).
    pub converting: BTreeSet<u64>,
    /// The transaction (`Tx::epoch`) this inode is registered in, 0 if none: it will
    /// be stored into its table block when that transaction closes.
    pub tx_epoch: u64,
    /// Writes in the middle of changing this inode without the metadata lock: a commit
    /// that stores it keeps it registered for the next transaction.
    pub pins: u32,
    /// Its size or block map changed since it was last stored: fdatasync must commit.
    pub data_meta_dirty: bool,
    /// Freed: a holder of its cell finds it gone.
    pub freed: bool,
    /// An O_TMPFILE file not opened with O_EXCL: `link` may give it its first name.
    pub linkable: bool,
    /// What its extent chain was counted as when it last registered.
    pub chain_counted: TxSize,
}

impl Inode {
    pub fn kind(&self) -> u32 {
        self.d.mode & f::S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.kind() == f::S_IFDIR
    }

    /// Device block of file block `lblk`, if allocated (written or not).
    pub fn map(&self, lblk: u64) -> Option<u64> {
        self.run_at(lblk).map(|(_, r, off)| r.phys + off)
    }

    /// Device block that holds the data of file block `lblk`: None for a hole and
    /// for an unwritten block (both read as zeros).
    pub fn map_data(&self, lblk: u64) -> Option<u64> {
        self.run_at(lblk).filter(|(_, r, _)| !r.unwritten).map(|(_, r, off)| r.phys + off)
    }

    /// Whether file block `lblk` is allocated but unwritten.
    pub fn is_unwritten(&self, lblk: u64) -> bool {
        self.run_at(lblk).is_some_and(|(_, r, _)| r.unwritten)
    }

    /// The run holding `lblk`: its first file block, the run, and `lblk`'s offset in it.
    fn run_at(&self, lblk: u64) -> Option<(u32, Run, u64)> {
        let (start, run) = self.extents.range(..=u32::try_from(lblk).ok()?).next_back()?;
        let off = lblk - *start as u64;
        (off < run.len as u64).then_some((*start, *run, off))
    }

    /// Number of data blocks mapped (unwritten ones included).
    pub fn data_blocks(&self) -> u64 {
        self.extents.values().map(|r| r.len as u64).sum()
    }

    /// Add a mapping, merging with the previous extent when contiguous.
    pub fn add_mapping(&mut self, lblk: u64, phys: u64, len: u64) {
        self.add_run(lblk, phys, len, false)
    }

    /// Add a mapping (`unwritten`: allocated, reads as zeros), merging with the
    /// previous extent when contiguous and of the same kind.
    pub fn add_run(&mut self, lblk: u64, phys: u64, len: u64, unwritten: bool) {
        if let Some((start, r)) = self.extents.range_mut(..lblk as u32).next_back() {
            if *start as u64 + r.len as u64 == lblk
                && r.phys + r.len as u64 == phys
                && r.unwritten == unwritten
                && r.len as u64 + len <= f::EXTENT_LEN_MAX as u64
            {
                r.len += len as u32;
                return;
            }
        }
        self.extents.insert(lblk as u32, Run { len: len as u32, phys, unwritten });
    }

    /// Forget the pages `from..to` wait to have written (their block reservations and
    /// pending unwritten-to-written marks): they were dropped. Returns how many
    /// reservations went, for the caller to give back (`Meta::add_reserved`).
    pub fn forget_pages(&mut self, from: u64, to: u64) -> u64 {
        let cut = |set: &mut BTreeSet<u64>| {
            let mut tail = set.split_off(&from);
            let mut kept = tail.split_off(&to);
            set.append(&mut kept);
            tail.len() as u64
        };
        cut(&mut self.converting);
        cut(&mut self.reserved)
    }

    /// Remove every mapping at or past `from`; returns the freed device runs.
    pub fn unmap_from(&mut self, from: u64) -> Vec<(u64, u64)> {
        self.unmap_range(from, u32::MAX as u64 + 1)
    }

    /// Cut the runs that overlap file blocks `from..to` at `from` and `to`, so that
    /// each run lies wholly inside or outside the range.
    fn split_at_bounds(&mut self, from: u64, to: u64) {
        for at in [from, to] {
            let Some((start, run, off)) = self.run_at(at) else { continue };
            if off == 0 {
                continue;
            }
            let head = Run { len: off as u32, ..run };
            let tail = Run { len: run.len - off as u32, phys: run.phys + off, unwritten: run.unwritten };
            self.extents.insert(start, head);
            self.extents.insert(at as u32, tail);
        }
    }

    /// The keys of the runs starting in `from..to` (after `split_at_bounds`, every run
    /// that overlaps the range).
    fn keys_in(&self, from: u64, to: u64) -> Vec<u32> {
        let Ok(from) = u32::try_from(from) else { return Vec::new() };
        match u32::try_from(to) {
            Ok(to) => self.extents.range(from..to).map(|(k, _)| *k).collect(),
            Err(_) => self.extents.range(from..).map(|(k, _)| *k).collect(),
        }
    }

    /// Merge runs that became contiguous and of one kind around `from..to`.
    fn merge_around(&mut self, from: u64, to: u64) {
        let lo = self.extents.range(..from.min(u32::MAX as u64) as u32).next_back().map(|(k, _)| *k);
        let keys: Vec<u32> = match lo {
            Some(lo) => self.keys_in(lo as u64, to.saturating_add(1)),
            None => self.keys_in(0, to.saturating_add(1)),
        };
        let mut prev: Option<u32> = None;
        for k in keys {
            if let Some(p) = prev {
                let (a, b) = (self.extents[&p], self.extents[&k]);
                if p as u64 + a.len as u64 == k as u64
                    && a.phys + a.len as u64 == b.phys
                    && a.unwritten == b.unwritten
                    && a.len as u64 + b.len as u64 <= f::EXTENT_LEN_MAX as u64
                {
                    self.extents.remove(&k);
                    self.extents.get_mut(&p).expect("present").len += b.len;
                    continue;
                }
            }
            prev = Some(k);
        }
    }

    /// Remove the mappings of file blocks `from..to`; returns the freed device runs.
    pub fn unmap_range(&mut self, from: u64, to: u64) -> Vec<(u64, u64)> {
        self.split_at_bounds(from, to);
        let mut freed = Vec::new();
        for k in self.keys_in(from, to) {
            let r = self.extents.remove(&k).expect("present");
            freed.push((r.phys, r.len as u64));
        }
        freed
    }

    /// Mark file blocks `from..to` written (`unwritten` false) or unwritten; holes in
    /// the range stay holes. Returns whether anything changed.
    pub fn set_written(&mut self, from: u64, to: u64, unwritten: bool) -> bool {
        if !self.keys_in(0, to).iter().any(|k| {
            let r = self.extents[k];
            (*k as u64 + r.len as u64) > from && r.unwritten != unwritten
        }) {
            return false;
        }
        self.split_at_bounds(from, to);
        for k in self.keys_in(from, to) {
            self.extents.get_mut(&k).expect("present").unwritten = unwritten;
        }
        self.merge_around(from, to);
        true
    }

    /// Move every run at or past file block `from` by `delta` blocks (collapse and
    /// insert range); a run across `from` is cut there first. Moving down, the caller
    /// has made room: no block is mapped in `from+delta..from`.
    pub fn shift_from(&mut self, from: u64, delta: i64) {
        self.split_at_bounds(from, from);
        let keys = self.keys_in(from, u32::MAX as u64 + 1);
        let moved: Vec<(u32, Run)> = keys.iter().map(|k| (*k, self.extents.remove(k).expect("present"))).collect();
        for (k, r) in moved {
            let to = (k as i64 + delta) as u32;
            self.extents.insert(to, r);
        }
        self.merge_around(from.saturating_sub(delta.unsigned_abs()), from + delta.unsigned_abs());
    }
}

/// What storing a dirty inode's extent chain adds to its transaction: every chain
/// block it keeps is rewritten, a new one also changes a bitmap block, a dropped one
/// is freed (a bitmap block) and revoked.
pub fn chain_cost(node: &Inode, bitmap_blocks: u64) -> TxSize {
    chain_cost_of(node, 0, bitmap_blocks)
}

/// `chain_cost` once the inode has gained `extra` extents. Reserved pages may or may
/// not have become extents when it is stored: the chain may grow to hold all of them
/// or shrink to hold only the extents mapped now.
pub fn chain_cost_of(node: &Inode, extra: u64, bitmap_blocks: u64) -> TxSize {
    if node.d.flags & f::INODE_FLAG_INLINE != 0 {
        return TxSize::default();
    }
    let blocks = |extents: u64| extents.saturating_sub(f::INLINE_EXTENTS as u64).div_ceil(f::EXTENTS_PER_BLOCK as u64);
    let pending = node.reserved.len() as u64 + 2 * node.converting.len() as u64;
    let most = blocks(node.extents.len() as u64 + pending + extra);
    let least = blocks(node.extents.len() as u64);
    let have = node.chain.len() as u64;
    let (grow, shrink) = (most.saturating_sub(have), have.saturating_sub(least));
    TxSize::new(most + grow.min(bitmap_blocks) + shrink.min(bitmap_blocks), shrink)
}

/// What a reader needs of an inode without locking its state: published by every
/// guard of the state as it is dropped, so always current for a reader that holds
/// the file's access lock (no one changes the size without holding it as a writer).
#[derive(Default)]
pub struct Published {
    pub size: AtomicU64,
    pub freed: AtomicBool,
}

/// One inode: its file-access lock, its state, and its readahead position.
/// In-memory index of one directory: name → (slot, inode), and the free slots.
#[derive(Default)]
pub struct DirIndex {
    pub names: HashMap<Vec<u8>, (u64, u64)>,
    pub free: BTreeSet<u64>,
    pub slots: u64,
}

/// Aligned to two cache lines (what the adjacent-line prefetcher pulls together): the
/// cells of directories made one after another sit side by side, and threads creating
/// in two of them wrote each other's lines (their locks and counts) at every create.
#[repr(align(128))]
pub struct InodeCell {
    pub ino: u64,
    /// The inode table block that holds it.
    pub table_block: u64,
    /// File type bits (S_IFMT): fixed for the inode's life.
    pub kind: u32,
    /// Orders access to the file's data (readers share, a writer excludes).
    pub io: FileLock,
    state: Mutex<Inode>,
    published: Published,
    /// Readahead of callers without a file handle.
    pub ra: RaState,
    /// Open handles (an unlinked inode lives until the last one is released).
    pub opens: std::sync::atomic::AtomicU32,
    /// One past the highest page index ever put in the cache for this inode: a
    /// truncate or delete looks for pages below it only.
    pages_end: AtomicU64,
    /// The write-back round (`FsInner::wb_round`) in which a writer last put pages of
    /// this file in the dirty set: write-back under pressure writes the files dirtied
    /// longest ago first (their writers have moved on), not the ones being written.
    pub dirtied_in: AtomicU64,
    /// A directory's names, once loaded (`Meta::dir`); `None` for other inodes.
    /// Changed under the metadata lock; read without it (`Fs::lookup`). A leaf lock:
    /// nothing else is taken under it. (A sharded lock here, and for the table below,
    /// measured slower: a create or delete writes both several times.) On lines of its
    /// own, as the cell.
    pub names: Option<Box<CachePadded<RwLock<Option<DirIndex>>>>>,
    /// Counts the changes that took a name away from its inode (a remove, a replace),
    /// each counted after it is made (`Meta::dir_unmap`): a lookup that found a name
    /// and then read its inode knows the name still led there when this has not moved
    /// meanwhile, without locking the index again (`Fs::lookup`). Each directory's cell
    /// starts it at a value of its own (`first_names_gen`), so that a directory freed
    /// and its number given to another between the two reads is not taken for the
    /// same one unchanged.
    pub names_gen: AtomicU64,
    /// The file is known to hold no file capabilities (`perm::FILE_CAPS`): set by a
    /// look that found none, cleared by a setxattr of that name, both under the
    /// metadata lock; read without it by every write (`Fs::kill_privs`).
    pub caps_absent: AtomicBool,
}

/// A starting `names_gen` no other directory cell of this process had: 2^32 apart
/// (a directory would need 2^32 removals to reach another's).
fn first_names_gen() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed) << 32
}

impl InodeCell {
    pub fn new(ino: u64, table_block: u64, node: Inode) -> InodeCell {
        let published = Published { size: AtomicU64::new(node.d.size), freed: AtomicBool::new(node.freed) };
        let names = (node.kind() == f::S_IFDIR).then(|| Box::new(CachePadded::new(RwLock::new(None))));
        let names_gen = if names.is_some() { first_names_gen() } else { 0 };
        InodeCell {
            ino,
            table_block,
            kind: node.kind(),
            io: FileLock::default(),
            state: Mutex::new(node),
            published,
            ra: RaState::default(),
            pages_end: AtomicU64::new(0),
            dirtied_in: AtomicU64::new(0),
            opens: Default::default(),
            names,
            names_gen: AtomicU64::new(names_gen),
            caps_absent: AtomicBool::new(false),
        }
    }

    /// A cell for an inode about to be created, with the type and permissions `mode`
    /// (`Meta::new_inode` gives it a number): its allocations are made before the
    /// metadata lock is taken.
    pub fn blank(mode: u32) -> Arc<InodeCell> {
        Arc::new(InodeCell::new(0, 0, Inode { d: DiskInode { mode, ..Default::default() }, ..Default::default() }))
    }

    /// Set the type and permissions of a blank cell nobody else holds yet (a
    /// directory gets its name index).
    pub fn set_mode(&mut self, mode: u32) {
        self.kind = mode & f::S_IFMT;
        self.names = (self.kind == f::S_IFDIR).then(|| Box::new(CachePadded::new(RwLock::new(None))));
        if self.names.is_some() {
            *self.names_gen.get_mut() = first_names_gen();
        }
        self.state.get_mut().d.mode = mode;
    }

    /// The state of a cell nobody else holds yet.
    pub fn state_mut(&mut self) -> &mut Inode {
        self.state.get_mut()
    }

    /// Pages up to (not including) `end` may be in the cache now.
    pub fn note_pages(&self, end: u64) {
        if self.pages_end.load(Ordering::Relaxed) < end {
            self.pages_end.fetch_max(end, Ordering::Relaxed);
        }
    }

    /// No page at or past this index is in the cache.
    pub fn pages_end(&self) -> u64 {
        self.pages_end.load(Ordering::Relaxed)
    }

    /// Lock the inode's state, for as long as the caller holds the cell.
    pub fn lock(&self) -> InodeGuard<'_> {
        self.take_lock();
        InodeGuard { cell: Holder::Borrowed(self), ino: self.ino, block: self.table_block }
    }

    /// Lock the inode's state; the guard keeps the cell (`Meta::inode`, whose callers
    /// go on using the metadata while they hold it).
    pub fn lock_owned(self: Arc<Self>) -> InodeGuard<'static> {
        self.take_lock();
        let (ino, block) = (self.ino, self.table_block);
        InodeGuard { cell: Holder::Owned(self), ino, block }
    }

    /// The state's raw lock, which the guard built next releases in its drop.
    /// (lock_api's own owned guard clones an Arc per lock, and this one carried a
    /// second: a create and a delete lock a dozen inodes each, and those counts were
    /// a tenth of their time.)
    fn take_lock(&self) {
        held::enter(self.ino);
        // SAFETY: the raw lock is taken here and released once, in the drop of the
        // guard the caller builds at once; the state is reached only through a guard.
        unsafe { self.state.raw() }.lock();
    }

    /// The size as last published (current for a holder of `io`).
    pub fn size(&self) -> u64 {
        self.published.size.load(Ordering::Acquire)
    }

    pub fn freed(&self) -> bool {
        self.published.freed.load(Ordering::Acquire)
    }

    pub fn is_dir(&self) -> bool {
        self.kind == f::S_IFDIR
    }
}

/// How a guard holds its cell.
enum Holder<'a> {
    Owned(Arc<InodeCell>),
    Borrowed(&'a InodeCell),
}

/// The locked state of an inode.
pub struct InodeGuard<'a> {
    cell: Holder<'a>,
    pub ino: u64,
    block: u64,
}

impl InodeGuard<'_> {
    fn cell(&self) -> &InodeCell {
        match &self.cell {
            Holder::Owned(c) => c,
            Holder::Borrowed(c) => c,
        }
    }
}

impl std::ops::Deref for InodeGuard<'_> {
    type Target = Inode;
    fn deref(&self) -> &Inode {
        // SAFETY: this guard holds the state's lock (taken by `take_lock`, released
        // in drop), and the cell outlives the guard (owned or borrowed).
        unsafe { &*self.cell().state.data_ptr() }
    }
}

impl std::ops::DerefMut for InodeGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inode {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { &mut *self.cell().state.data_ptr() }
    }
}

impl Drop for InodeGuard<'_> {
    fn drop(&mut self) {
        let (size, freed) = (self.d.size, self.freed);
        let cell = self.cell();
        cell.published.size.store(size, Ordering::Release);
        cell.published.freed.store(freed, Ordering::Release);
        // SAFETY: the lock was taken for this guard (`take_lock`) and is released
        // once, here.
        unsafe { cell.state.raw().unlock() };
        held::leave(self.ino);
    }
}

impl InodeGuard<'_> {
    /// The inode joins the running transaction (or updates what its extent chain may
    /// add to it). With `room`, only if the transaction then still fits that many log
    /// blocks: false if it does not (the caller commits and tries again).
    pub fn register(&mut self, tx: &Tx, room: Option<u64>) -> bool {
        let cost = chain_cost(self, tx.bitmap_blocks());
        // Registered in the running transaction already, with the same chain: nothing
        // to change (a create registers its directory, whose entry was counted by the
        // create before it). A freed inode's `tx_epoch` is cleared as it is forgotten.
        if self.tx_epoch == tx.epoch() && !self.chain_changed(cost) {
            return true;
        }
        match tx.register(self.ino, self.block, cost, room) {
            Some(epoch) => {
                self.tx_epoch = epoch;
                self.chain_counted = cost;
                true
            }
            None => false,
        }
    }
}

impl Inode {
    fn chain_changed(&self, cost: TxSize) -> bool {
        self.chain_counted != cost
    }
}

type Shard = Mutex<HashMap<u64, Arc<InodeCell>, std::hash::BuildHasherDefault<InoHasher>>>;

/// Inodes in memory, by number, in shards (the data path looks them up on every call).
/// Each shard has cache lines of its own: two threads working in two directories
/// lock different shards without passing a line between their CPUs.
pub struct InodeTable {
    shards: Box<[crossbeam_utils::CachePadded<Shard>]>,
    /// The root's cell, once loaded. Every path walk starts at it and it is never
    /// freed, so `with` reaches it without a shard's lock: threads walking paths in
    /// parallel do not all write the lock of the root's shard.
    root: std::sync::OnceLock<Arc<InodeCell>>,
}

/// Inode numbers come from the file system, not from outside: a multiply is enough
/// (SipHash showed in profiles of create+stat+unlink).
#[derive(Default, Clone, Copy)]
pub struct InoHasher(u64);

impl std::hash::Hasher for InoHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Default for InodeTable {
    fn default() -> Self {
        InodeTable {
            shards: (0..256).map(|_| crossbeam_utils::CachePadded::new(Mutex::new(HashMap::default()))).collect(),
            root: Default::default(),
        }
    }
}

impl InodeTable {
    /// 256 shards: two threads' files then rarely share a shard's lock (each create
    /// and delete takes it), even with 8 threads in 8 directories.
    fn shard(&self, ino: u64) -> &Shard {
        // Bits below the top seven: those are hashbrown's tag of the same hash
        // (`InoHasher`), which would then be one value for a whole shard.
        &self.shards[(ino.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize % self.shards.len()]
    }

    pub fn get(&self, ino: u64) -> Option<Arc<InodeCell>> {
        if ino == f::ROOT_INO {
            if let Some(root) = self.root.get() {
                return Some(root.clone());
            }
        }
        self.shard(ino).lock().get(&ino).cloned()
    }

    /// `f` of the inode's cell, if it is in memory, without taking a reference to it
    /// (a cell that many threads reach, such as the root's, keeps its count still).
    pub fn with<T>(&self, ino: u64, f: impl FnOnce(&InodeCell) -> T) -> Option<T> {
        if ino == f::ROOT_INO {
            if let Some(root) = self.root.get() {
                return Some(f(root));
            }
        }
        self.shard(ino).lock().get(&ino).map(|c| f(c))
    }

    pub fn insert(&self, cell: Arc<InodeCell>) {
        if cell.ino == f::ROOT_INO {
            let _ = self.root.set(cell.clone());
        }
        self.shard(cell.ino).lock().insert(cell.ino, cell);
    }

    /// Every inode in memory.
    pub fn cells(&self) -> Vec<Arc<InodeCell>> {
        self.shards.iter().flat_map(|s| s.lock().values().cloned().collect::<Vec<_>>()).collect()
    }

    pub fn remove(&self, ino: u64) -> Option<Arc<InodeCell>> {
        debug_assert_ne!(ino, f::ROOT_INO, "the root is never freed");
        self.shard(ino).lock().remove(&ino)
    }
}

/// Debug builds remember which inodes each thread has locked, and panic on locking
/// one again (a deadlock otherwise).
mod held {
    #[cfg(debug_assertions)]
    thread_local! {
        static HELD: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    #[cfg(debug_assertions)]
    pub fn enter(ino: u64) {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            assert!(!h.contains(&ino), "inode {ino} locked twice by one thread (deadlock)");
            h.push(ino);
        });
    }

    #[cfg(debug_assertions)]
    pub fn leave(ino: u64) {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|x| *x == ino) {
                h.swap_remove(i);
            }
        });
    }

    #[cfg(not(debug_assertions))]
    pub fn enter(_: u64) {}

    #[cfg(not(debug_assertions))]
    pub fn leave(_: u64) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(extents: &[(u32, u32, u64)]) -> Inode {
        let mut n = Inode::default();
        for (l, len, p) in extents {
            n.extents.insert(*l, Run { len: *len, phys: *p, unwritten: false });
        }
        n
    }

    #[test]
    fn unmap_range_splits_extents() {
        let mut n = node(&[(0, 10, 100), (10, 5, 200), (20, 4, 300)]);
        let mut freed = n.unmap_range(3, 12);
        freed.sort();
        assert_eq!(freed, vec![(103, 7), (200, 2)]);
        assert_eq!(n.map(2), Some(102));
        assert_eq!(n.map(3), None);
        assert_eq!(n.map(11), None);
        assert_eq!(n.map(12), Some(202));
        assert_eq!(n.map(21), Some(301));
        let freed = n.unmap_from(21);
        assert_eq!(freed, vec![(301, 3)]);
        assert_eq!(n.data_blocks(), 3 + 3 + 1);
    }

    #[test]
    fn add_mapping_merges_contiguous_runs() {
        let mut n = node(&[]);
        n.add_mapping(0, 50, 2);
        n.add_mapping(2, 52, 3);
        n.add_mapping(5, 90, 1);
        assert_eq!(n.extents.len(), 2);
        assert_eq!(n.map(4), Some(54));
        assert_eq!(n.map(5), Some(90));
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "locked twice")]
    fn locking_an_inode_twice_panics_in_debug_builds() {
        let cell = InodeCell::new(7, 100, Inode::default());
        let _a = cell.lock();
        let _b = cell.lock();
    }
}
