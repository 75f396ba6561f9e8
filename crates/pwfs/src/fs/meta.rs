//! Metadata state of a mounted file system: cached metadata blocks, the namespace
//! (directory indexes, open counts, inodes to free) and the allocators.
//!
//! Everything here is guarded by one mutex (`FsInner::meta`) and is never held across
//! data I/O; it does read metadata blocks on a miss. Inodes live in their own cells
//! (`fs::inode`), reached from here with `Meta::inode`, which loads and locks one.
//! Every change to a metadata block goes through [`Meta::modify`], which puts the block
//! in the running transaction (`fs::tx`); [`Meta::take_tx`] stores the registered
//! inodes and turns the transaction into journal images.

use super::inode::{chain_cost, chain_cost_of, Inode, InodeCell, InodeGuard, InodeTable, Run};
use super::tx::Tx;
pub use super::tx::TxSize;
use crate::alloc::Allocator;
use crate::device::{AlignedBuf, Device};
use crate::error::{Error, Result};
use crate::format::{self as f, DiskInode, Extent, ExtentBlock, Superblock, Timespec, BLOCK, BLOCK_SIZE};
use crate::journal::Transaction;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

pub use super::inode::DirIndex;

pub struct Meta {
    pub sb: Superblock,
    dev: Arc<dyn Device>,
    blocks: HashMap<u64, AlignedBuf, NumHash>,
    /// Committed since the last checkpoint: the cached copy is newer than home.
    pub pinned: HashSet<u64, NumHash>,
    /// The hitchhiking buffer: a data block it holds is revoked when freed.
    pub hitch: Arc<crate::hitchhike::Hitchhike>,
    /// Directory blocks changed in the running transaction and not sealed since: their
    /// checksums are computed once, when the transaction closes or the block is
    /// decoded (`sealed`), not at every entry they gain or lose.
    unsealed: HashSet<u64, NumHash>,
    /// Blocks this lock's holders put in the running transaction since it last closed
    /// (`take_blocks`) and not revoked since: `modify` does not take the transaction's
    /// lock again for them. That lock's line passed between the CPUs at every
    /// directory and bitmap block a create or delete changed.
    in_tx: HashSet<u64, NumHash>,
    /// Inodes in memory (shared with the data path, which reaches them without this lock).
    pub table: Arc<InodeTable>,
    /// The cells this lock's holders reached last, by inode number (direct-mapped):
    /// an operation reaches its parent and its inode a dozen times, and a lookup in
    /// `table` costs a shard lock and takes its cache line from the other CPUs. A slot
    /// per 128 bytes (two lines, as the prefetcher pulls them), and 256 of them:
    /// threads creating in directories of their own write their slots at every create
    /// and delete, and slots sharing a line (or a slot two inodes meet in) passed
    /// between the CPUs each time.
    recent: [crossbeam_utils::CachePadded<Option<Arc<InodeCell>>>; RECENT],
    /// The running transaction's bookkeeping (its own lock).
    pub tx: Arc<Tx>,
    pub alloc: Allocator,
    /// Blocks promised to delayed allocations (`add_reserved`).
    reserved: u64,
    iused: Vec<u64>,
    pub ifree: u64,
    ihint: u64,
    /// Unlinked inodes with no open handle; freed at the start of the next commit.
    pub to_free: BTreeSet<u64>,
    block_limit: usize,
}

const RECENT: usize = 256;

/// The slot of `recent` an inode goes to: hashed, since inode numbers of directories
/// are multiples of `GROUP` and would all meet in one slot.
fn recent_slot(ino: u64) -> usize {
    (ino.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as usize % RECENT
}

/// At most the bitmap blocks that freeing the mappings of `node` at and past file
/// block `from` changes, on a device with `bitmap` of them.
fn unmap_cost_of(node: &Inode, from: u64, bitmap: u64) -> u64 {
    let mut n = 0u64;
    for (start, run) in node.extents.iter().rev() {
        if (*start as u64 + run.len as u64) <= from {
            break;
        }
        n += (run.len as u64).div_ceil(f::BITS_PER_BITMAP_BLOCK) + 1;
        if n >= bitmap {
            return bitmap;
        }
    }
    n
}

/// Inode numbers a new directory claims a group of: its files are numbered inside it.
const GROUP: u64 = 512;

/// Where a new inode's number is looked for.
#[derive(Clone, Copy, Debug)]
pub enum Place {
    /// The first free number at or after this one (a file, next to its directory).
    Near(u64),
    /// The start of an empty group (a directory), else anywhere.
    NewGroup,
}

/// Block and inode numbers come from the file system: a multiply hashes them.
type NumHash = std::hash::BuildHasherDefault<crate::fs::inode::InoHasher>;

pub fn now() -> Timespec {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Timespec { sec: d.as_secs() as i64, nsec: d.subsec_nanos() }
}

pub fn ftype_of(mode: u32) -> u8 {
    match mode & f::S_IFMT {
        f::S_IFREG => 8,
        f::S_IFDIR => 4,
        f::S_IFLNK => 10,
        f::S_IFIFO => 1,
        f::S_IFCHR => 2,
        f::S_IFBLK => 6,
        f::S_IFSOCK => 12,
        _ => 0,
    }
}

fn bit(words: &[u64], i: u64) -> bool {
    words[(i / 64) as usize] & (1 << (i % 64)) != 0
}

impl Meta {
    /// Load the allocators from the on-disk bitmaps (after journal replay).
    pub fn load(
        sb: Superblock,
        dev: Arc<dyn Device>,
        preloaded: BTreeMap<u64, Vec<u8>>,
        table: Arc<InodeTable>,
        tx: Arc<Tx>,
    ) -> Result<Meta> {
        let mut m = Meta {
            alloc: Allocator::new(sb.data_start, sb.data_blocks()),
            iused: vec![0; sb.inode_count.div_ceil(64) as usize],
            ifree: sb.inode_count,
            ihint: 0,
            sb,
            dev,
            blocks: HashMap::default(),
            pinned: HashSet::default(),
            hitch: Arc::new(crate::hitchhike::Hitchhike::new(false, 0, 0, 0)),
            unsealed: HashSet::default(),
            in_tx: HashSet::default(),
            recent: std::array::from_fn(|_| Default::default()),
            table,
            tx,
            reserved: 0,
            to_free: BTreeSet::new(),
            block_limit: 16384,
        };
        // Images replayed in memory only (read-only mounts) stay pinned.
        for (b, img) in preloaded {
            m.blocks.insert(b, AlignedBuf::from_slice(&img));
            m.pinned.insert(b);
        }
        let sb = m.sb.clone();
        for i in 0..sb.block_bitmap_blocks {
            let b = m.block(sb.block_bitmap_start + i)?;
            f::bitmap_check(b, i)?;
            let bits: Vec<u8> = b[..BLOCK_SIZE - 4].to_vec();
            for (byte_i, byte) in bits.iter().enumerate() {
                if *byte == 0 {
                    continue;
                }
                for k in 0..8 {
                    let blk = i * f::BITS_PER_BITMAP_BLOCK + byte_i as u64 * 8 + k;
                    if byte & (1 << k) != 0 && blk >= sb.data_start && blk < sb.data_end {
                        m.alloc.mark_used(blk);
                    }
                }
            }
        }
        for i in 0..sb.inode_bitmap_blocks {
            let b = m.block(sb.inode_bitmap_start + i)?;
            f::bitmap_check(b, i)?;
            let bits: Vec<u8> = b[..BLOCK_SIZE - 4].to_vec();
            for (byte_i, byte) in bits.iter().enumerate() {
                for k in 0..8 {
                    let n = i * f::BITS_PER_BITMAP_BLOCK + byte_i as u64 * 8 + k;
                    if byte & (1 << k) != 0 && n < sb.inode_count {
                        m.iused[(n / 64) as usize] |= 1 << (n % 64);
                        m.ifree -= 1;
                    }
                }
            }
        }
        Ok(m)
    }

    // ------------------------------------------------------------ blocks

    /// The cached image of a metadata block, read on a miss.
    pub fn block(&mut self, b: u64) -> Result<&mut AlignedBuf> {
        if !self.blocks.contains_key(&b) {
            if b >= self.sb.total_blocks {
                return Err(Error::corrupt(format!("metadata block {b} past the end of the device")));
            }
            self.shrink();
            let (buf, r) = self.dev.read(b * BLOCK, self.dev.alloc(BLOCK_SIZE));
            r?;
            self.blocks.insert(b, buf);
        }
        Ok(self.blocks.get_mut(&b).expect("just loaded"))
    }

    /// The cached block, its directory-block checksum brought up to date if entries
    /// changed since it was last sealed.
    fn sealed(&mut self, b: u64) -> Result<&mut AlignedBuf> {
        let stale = self.unsealed.remove(&b);
        let buf = self.block(b)?;
        if stale {
            f::dir_block_seal(buf);
        }
        Ok(buf)
    }

    /// The block, made part of the running transaction.
    pub fn modify(&mut self, b: u64) -> Result<&mut AlignedBuf> {
        self.block(b)?;
        self.tx_block(b);
        Ok(self.blocks.get_mut(&b).expect("just loaded"))
    }

    /// `b` joins the running transaction.
    fn tx_block(&mut self, b: u64) {
        if self.in_tx.insert(b) {
            self.tx.block(b);
        }
    }

    /// `b` leaves the running transaction and is revoked in it. (A block freed here is
    /// handed out again only after this transaction is durable, so it is not changed
    /// again in it; forgetting it in `in_tx` keeps that from mattering.)
    pub fn revoke(&mut self, b: u64) {
        self.in_tx.remove(&b);
        self.tx.revoke(b);
    }

    /// A freshly allocated metadata block: zeroed, in the transaction, not read.
    fn fresh(&mut self, b: u64) -> &mut AlignedBuf {
        self.tx_block(b);
        self.unsealed.remove(&b);
        let buf = self.dev.alloc_zeroed(BLOCK_SIZE);
        self.blocks.insert(b, buf);
        self.blocks.get_mut(&b).expect("just inserted")
    }

    fn shrink(&mut self) {
        if self.blocks.len() < self.block_limit {
            return;
        }
        let dirty = self.tx.blocks();
        let pinned = &self.pinned;
        let mut n = self.blocks.len() / 2;
        self.blocks.retain(|b, _| {
            if n > 0 && !dirty.contains(b) && !pinned.contains(b) {
                n -= 1;
                return false;
            }
            true
        });
    }

    /// The size bound of the running transaction (`fs::tx`).
    pub fn tx_size(&self) -> TxSize {
        self.tx.size()
    }

    /// At most what registering `ino` adds to the running transaction once it has
    /// gained `extra` extents: its table block and its whole extent chain.
    pub fn inode_cost(&mut self, ino: u64, extra: u64) -> Result<TxSize> {
        let bitmap = self.sb.block_bitmap_blocks;
        self.peek(ino, |node| TxSize::new(1, 0).plus(chain_cost_of(node, extra, bitmap)))
    }

    /// At most the bitmap blocks that freeing the mappings of `node` at and past file
    /// block `from` changes.
    pub fn unmap_cost(&self, node: &Inode, from: u64) -> u64 {
        unmap_cost_of(node, from, self.sb.block_bitmap_blocks)
    }

    /// At most what freeing `ino` (`free_inode`) adds to the running transaction.
    pub fn free_cost(&mut self, ino: u64) -> Result<TxSize> {
        let bitmap = self.sb.block_bitmap_blocks;
        self.peek(ino, |node| {
            let spans = unmap_cost_of(node, 0, bitmap);
            let journaled = node.is_dir() || node.kind() == f::S_IFLNK;
            let meta_blocks = node.chain.len() as u64 + node.xattr_blocks;
            let revokes = meta_blocks + if journaled { node.data_blocks() } else { 0 };
            // Table block, inode bitmap block, block bitmap blocks.
            TxSize::new(2 + (spans + meta_blocks).min(bitmap), revokes)
        })
    }

    /// Free part of an inode too large to free in one transaction of at most
    /// `room` log blocks: unmap its last extents while they fit (its blocks are
    /// freed, the inode keeps the rest and stays unlinked). Returns whether anything
    /// was unmapped.
    pub fn trim_inode(&mut self, ino: u64, room: u64) -> Result<bool> {
        let bitmap = self.sb.block_bitmap_blocks;
        let mut trimmed = false;
        loop {
            let tx = self.tx_size();
            let mut node = self.inode(ino)?;
            let journaled = node.is_dir() || node.kind() == f::S_IFLNK;
            let base = tx.plus(TxSize::new(1, 0)).plus(chain_cost(&node, bitmap));
            let Some((&start, run)) = node.extents.iter().next_back() else { break };
            let len = run.len;
            // Split a long extent so that one piece always fits.
            let len = len as u64;
            let piece = if journaled { len.min(f::JDESC_ENTRIES as u64) } else { len };
            let cost = TxSize::new(piece.div_ceil(f::BITS_PER_BITMAP_BLOCK) + 1, if journaled { piece } else { 0 });
            if base.plus(cost).log_blocks() > room {
                break;
            }
            let from = start as u64 + len - piece;
            let freed = node.unmap_range(from, start as u64 + len);
            if node.is_dir() {
                // A directory's size is its blocks (no holes: it is cut from the end),
                // in every transaction that stores it, or the next mount refuses it.
                node.d.size = from * f::BLOCK;
            }
            node.register(&self.tx, None);
            drop(node);
            for (b, n) in freed {
                self.free_blocks(b, n, journaled)?;
            }
            trimmed = true;
        }
        Ok(trimmed)
    }

    /// Whether nothing has changed since the last commit.
    pub fn tx_is_empty(&self) -> bool {
        self.tx.is_empty()
    }

    /// Close the running transaction: store its inodes into their table blocks and
    /// hand out copies of every changed block, the revokes, and the frees to release
    /// once it is durable.
    /// Close the running transaction: store its inodes, copy its blocks. `written`:
    /// the inodes whose dirty data the commit wrote (None: all); an inode outside it
    /// whose size or block map changed keeps `data_meta_dirty`, so that the next
    /// commit for an fsync writes its data too.
    pub fn take_tx(&mut self, written: Option<&BTreeSet<u64>>) -> Result<(Transaction, Vec<(u64, u64)>)> {
        let closing = self.tx.close_inodes();
        for (ino, counted) in closing.inodes {
            // Paired with the bound the inode registered with: operations are
            // admitted against it, so a chain that grew past it could outgrow the
            // journal.
            let keep = written.is_some_and(|w| !w.contains(&ino));
            let done = self.store_inode(ino, closing.epoch, keep)?;
            if done.images > counted.images || done.revokes > counted.revokes {
                return Err(Error::corrupt(format!(
                    "bug: inode {ino} stored {done:?} of extent chain, registered as at most {counted:?}"
                )));
            }
        }
        // What `in_tx` spares `Tx::block` must be in the transaction (a revoke that
        // went around `Meta::revoke` would break that, and lose the block's change).
        debug_assert!(
            {
                let blocks = self.tx.blocks();
                self.in_tx.iter().all(|b| blocks.contains(b))
            },
            "a block `in_tx` is not in the transaction"
        );
        let (dirty, revokes) = self.tx.take_blocks();
        self.in_tx.clear();
        debug_assert!(
            self.unsealed.iter().all(|b| dirty.contains(b)),
            "an unsealed directory block outside the transaction"
        );
        // Pinned at once: until the journal has them, and until a checkpoint writes them
        // home, their only current copy is this cache (a shrink must not drop one and
        // read the stale home block back).
        self.pinned.extend(dirty.iter().copied());
        let mut images = Vec::with_capacity(dirty.len());
        for b in dirty {
            // Bitmap blocks are sealed here, once per transaction, not at every bit
            // they change (a create and a delete changed two or three each: their
            // checksums were 7% of the time of two threads creating and deleting,
            // under the metadata lock). Nothing reads a checksum from the cache.
            if let Some(i) = self.bitmap_index(b) {
                f::bitmap_seal(self.block(b)?, i);
            }
            self.sealed(b)?;
            let mut copy = self.dev.alloc(BLOCK_SIZE);
            copy.copy_from_slice(self.block(b)?);
            self.check_before_write(b, &copy)?;
            images.push((b, copy));
        }
        let frees = self.alloc.take_pending();
        Ok((
            Transaction { images, revokes: revokes.into_iter().collect(), data: Vec::new(), retired: Vec::new() },
            frees,
        ))
    }

    /// The index of a block- or inode-bitmap block among its kind (its checksum's seed).
    fn bitmap_index(&self, b: u64) -> Option<u64> {
        let sb = &self.sb;
        [(sb.block_bitmap_start, sb.block_bitmap_blocks), (sb.inode_bitmap_start, sb.inode_bitmap_blocks)]
            .into_iter()
            .find(|(start, n)| b >= *start && b < start + n)
            .map(|(start, _)| b - start)
    }

    /// Paired assertion: a bitmap block about to be logged must carry a valid checksum.
    fn check_before_write(&self, b: u64, img: &[u8]) -> Result<()> {
        let sb = &self.sb;
        let check = |start: u64, n: u64| -> Result<()> {
            if b >= start && b < start + n {
                f::bitmap_check(img, b - start)
                    .map_err(|e| Error::corrupt(format!("bug: unsealed bitmap block {b}: {e}")))?;
            }
            Ok(())
        };
        check(sb.block_bitmap_start, sb.block_bitmap_blocks)?;
        check(sb.inode_bitmap_start, sb.inode_bitmap_blocks)
    }

    // ------------------------------------------------------------ bitmaps

    fn set_bitmap(&mut self, start: u64, n: u64, value: bool) -> Result<()> {
        let (blk, i) = (n / f::BITS_PER_BITMAP_BLOCK, n % f::BITS_PER_BITMAP_BLOCK);
        let b = self.modify(start + blk)?;
        let byte = &mut b[(i / 8) as usize];
        if value {
            *byte |= 1 << (i % 8);
        } else {
            *byte &= !(1 << (i % 8));
        }
        // Sealed when the transaction closes (`take_tx`).
        Ok(())
    }

    /// Set or clear the bits of a run of blocks (sealed when the transaction closes).
    fn mark_blocks(&mut self, first: u64, count: u64, used: bool) -> Result<()> {
        let per = f::BITS_PER_BITMAP_BLOCK;
        let mut b = first;
        while b < first + count {
            let blk = b / per;
            let end = (first + count).min((blk + 1) * per);
            let buf = self.modify(self.sb.block_bitmap_start + blk)?;
            for i in (b % per)..(b % per + (end - b)) {
                let byte = &mut buf[(i / 8) as usize];
                if used {
                    *byte |= 1 << (i % 8);
                } else {
                    *byte &= !(1 << (i % 8));
                }
            }
            b = end;
        }
        Ok(())
    }

    /// Free blocks a caller may still promise (allocator free minus reservations).
    pub fn available(&self) -> u64 {
        self.alloc.free_blocks().saturating_sub(self.reserved)
    }

    /// Promise (`n` > 0) or release blocks for delayed allocation; the transaction
    /// counts the bitmap blocks their write-back will change.
    pub fn add_reserved(&mut self, n: i64) {
        self.reserved = self.reserved.checked_add_signed(n).expect("reservations balance");
        self.tx.set_reserved(self.reserved);
    }

    /// Allocate a run of data blocks (for reserved pages: the reservation is consumed).
    pub fn alloc_data(&mut self, want: u64, goal: Option<u64>) -> Result<(u64, u64)> {
        let (first, n) = self.alloc.alloc(want, goal).ok_or_else(|| Error::no_space("no free data blocks"))?;
        self.mark_blocks(first, n, true)?;
        Ok((first, n))
    }

    /// One block for metadata; refuses to eat into space promised to written data.
    pub fn alloc_meta(&mut self) -> Result<u64> {
        if self.available() == 0 {
            return Err(Error::no_space("no free blocks"));
        }
        let (b, _) = self.alloc_data(1, None)?;
        Ok(b)
    }

    /// Free a run. `journaled` runs held metadata and get a revoke record.
    pub fn free_blocks(&mut self, first: u64, count: u64, journaled: bool) -> Result<()> {
        // A block an inode maps but the bitmap holds free: the image is damaged (and
        // the block may be another file's by now).
        if !self.alloc.all_used(first, count) {
            return Err(Error::corrupt(format!("freeing blocks {first}+{count}: not all of them are in use")));
        }
        self.mark_blocks(first, count, false)?;
        self.alloc.free(first, count);
        for b in first..first + count {
            // A data block the journal carries (hitchhiking) is revoked like metadata.
            if journaled || self.hitch.forget(b) {
                self.revoke(b);
                self.pinned.remove(&b);
            }
            self.blocks.remove(&b);
            self.unsealed.remove(&b);
        }
        Ok(())
    }

    // ------------------------------------------------------------ inodes

    fn inode_slot(&self, ino: u64) -> (u64, usize) {
        let i = ino - 1;
        (self.sb.inode_table_start + i / f::INODES_PER_BLOCK, (i % f::INODES_PER_BLOCK) as usize * f::INODE_SIZE)
    }

    pub fn valid_ino(&self, ino: u64) -> bool {
        ino >= 1 && ino <= self.sb.inode_count && bit(&self.iused, ino - 1)
    }

    /// The inode's cell, loaded from its table block on first use.
    pub fn cell(&mut self, ino: u64) -> Result<Arc<InodeCell>> {
        let slot = recent_slot(ino);
        if let Some(cell) = self.recent[slot].as_ref().filter(|c| c.ino == ino) {
            return Ok(cell.clone());
        }
        if let Some(cell) = self.table.get(ino) {
            *self.recent[slot] = Some(cell.clone());
            return Ok(cell);
        }
        if !self.valid_ino(ino) {
            return Err(Error::not_found(format!("inode {ino} is not in use")));
        }
        let node = self.load_inode(ino)?;
        let cell = Arc::new(InodeCell::new(ino, self.inode_slot(ino).0, node));
        self.table.insert(cell.clone());
        Ok(cell)
    }

    /// The slot of `recent` holding the inode's cell (put there if it was not).
    fn recent_cell(&mut self, ino: u64) -> Result<usize> {
        let slot = recent_slot(ino);
        if self.recent[slot].as_ref().is_none_or(|c| c.ino != ino) {
            let cell = self.cell(ino)?;
            *self.recent[slot] = Some(cell);
        }
        Ok(slot)
    }

    /// The inode's cell, borrowed from `recent`: no count of the cell's references
    /// taken and given back. A create and a delete reach their directory and inode a
    /// dozen times under the metadata lock, and those counts (two atomic operations
    /// each) were a sixth of the time the lock was held.
    fn cell_ref(&mut self, ino: u64) -> Result<&InodeCell> {
        let slot = self.recent_cell(ino)?;
        Ok(self.recent[slot].as_deref().expect("put in `recent` by `recent_cell`"))
    }

    /// `f` of the inode, loaded and locked for the call (as `inode`, without the
    /// cell's reference count).
    pub fn peek<T>(&mut self, ino: u64, f: impl FnOnce(&Inode) -> T) -> Result<T> {
        Ok(f(&self.cell_ref(ino)?.lock()))
    }

    /// The inode, loaded and locked. Hold one guard of an inode at a time: locking it
    /// again while the guard lives deadlocks (debug builds panic).
    pub fn inode(&mut self, ino: u64) -> Result<InodeGuard<'static>> {
        Ok(self.cell(ino)?.lock_owned())
    }

    fn load_inode(&mut self, ino: u64) -> Result<Inode> {
        let (blk, off) = self.inode_slot(ino);
        let b = self.block(blk)?;
        let d = DiskInode::decode(ino, &b[off..off + f::INODE_SIZE])?
            .ok_or_else(|| Error::corrupt(format!("inode {ino} is marked in use but its slot is empty")))?;
        let mut node = Inode { d, ..Default::default() };
        let mut all: Vec<Extent> = node.d.extents.clone();
        let mut next = node.d.ext_block;
        // A set beside the chain: a damaged count lets a chain run to millions of
        // blocks, and a look through the list for each was quadratic.
        let mut seen = std::collections::HashSet::new();
        while next != 0 {
            if node.chain.len() as u64 > node.d.n_extents as u64 / f::EXTENTS_PER_BLOCK as u64 + 1
                || next < self.sb.data_start
                || next >= self.sb.data_end
                || !seen.insert(next)
                || all.len() > node.d.n_extents as usize
            {
                return Err(Error::corrupt(format!("inode {ino}: bad extent chain")));
            }
            let eb = ExtentBlock::decode(self.block(next)?)?;
            if eb.ino != ino {
                return Err(Error::corrupt(format!("inode {ino}: extent block {next} belongs to inode {}", eb.ino)));
            }
            node.chain.push(next);
            all.extend(eb.extents);
            next = eb.next;
        }
        if all.len() != node.d.n_extents as usize && node.d.flags & f::INODE_FLAG_INLINE == 0 {
            return Err(Error::corrupt(format!("inode {ino}: extent count mismatch")));
        }
        for e in all {
            let beyond = e.physical.checked_add(e.len as u64).is_none_or(|end| end > self.sb.data_end);
            if e.len == 0 || e.physical < self.sb.data_start || beyond {
                return Err(Error::corrupt(format!("inode {ino}: extent outside the data area")));
            }
            if e.logical as u64 + e.len as u64 > f::MAX_FILE_SIZE / f::BLOCK {
                return Err(Error::corrupt(format!("inode {ino}: extent past the largest file")));
            }
            if e.unwritten && node.kind() != f::S_IFREG {
                return Err(Error::corrupt(format!("inode {ino}: unwritten extent in a file that is not regular")));
            }
            if node.extents.insert(e.logical, Run { len: e.len, phys: e.physical, unwritten: e.unwritten }).is_some() {
                return Err(Error::corrupt(format!("inode {ino}: two extents at file block {}", e.logical)));
            }
        }
        // Extents do not overlap, and a directory's cover exactly its size: its blocks
        // are numbered by entry slot, and one it grows into must be unmapped.
        let mut end = 0u64;
        for (&logical, run) in &node.extents {
            if (logical as u64) < end {
                return Err(Error::corrupt(format!("inode {ino}: overlapping extents at file block {logical}")));
            }
            end = logical as u64 + run.len as u64;
        }
        if node.is_dir()
            && (!node.d.size.is_multiple_of(BLOCK)
                || node.data_blocks() != node.d.size / BLOCK
                || end != node.d.size / BLOCK)
        {
            return Err(Error::corrupt(format!(
                "inode {ino}: directory size {} does not match its blocks",
                node.d.size
            )));
        }
        // The attribute blocks are what the block count holds beyond data and chain.
        let x = node.d.blocks.checked_sub(node.data_blocks() + node.chain.len() as u64);
        node.xattr_blocks = match (x, node.d.xattr_block) {
            (Some(0), 0) => 0,
            (Some(n), b) if b != 0 && (1..=f::XATTR_BLOCKS_MAX as u64).contains(&n) => n,
            _ => return Err(Error::corrupt(format!("inode {ino}: block count {} does not add up", node.d.blocks))),
        };
        Ok(node)
    }

    /// The end of a change to the data of an inode held as `node` (punch, zero,
    /// collapse, insert, truncate): its modification and change times move, fdatasync
    /// must commit, it joins the running transaction; `reserved` blocks of delayed
    /// allocation are promised (> 0) or given back, and the `freed` data runs are freed.
    pub fn finish_data_change(&mut self, mut node: InodeGuard, reserved: i64, freed: Vec<(u64, u64)>) -> Result<()> {
        let t = now();
        node.d.mtime = t;
        node.d.ctime = t;
        node.data_meta_dirty = true;
        node.register(&self.tx, None);
        drop(node);
        self.add_reserved(reserved);
        for (b, n) in freed {
            self.free_blocks(b, n, false)?;
        }
        Ok(())
    }

    /// Change an inode and register it with the running transaction (its table block
    /// now, so that the transaction's size counts distinct blocks; its slot and extents
    /// when the transaction closes). Every change to an inode's extents or reserved
    /// pages is followed by this, or by `InodeGuard::register` where the caller holds
    /// the inode.
    pub fn update<T>(&mut self, ino: u64, f: impl FnOnce(&mut Inode) -> T) -> Result<T> {
        let slot = self.recent_cell(ino)?;
        let mut node = self.recent[slot].as_deref().expect("put in `recent` by `recent_cell`").lock();
        let v = f(&mut node);
        node.register(&self.tx, None);
        Ok(v)
    }

    /// Write an inode (and its extent chain) into the cached metadata blocks, as the
    /// transaction that closed at `epoch` holds it; returns what its extent chain
    /// added. An inode that must stay in the next transaction (a write in the middle of
    /// changing it, pages still reserved) registers there again.
    fn store_inode(&mut self, ino: u64, epoch: u64, keep_data_meta_dirty: bool) -> Result<TxSize> {
        let Some(cell) = self.table.get(ino) else {
            return Ok(TxSize::default());
        };
        let mut node = cell.lock();
        if node.freed {
            return Ok(TxSize::default());
        }
        let extents: Vec<Extent> = node
            .extents
            .iter()
            .map(|(l, r)| Extent { logical: *l, len: r.len, physical: r.phys, unwritten: r.unwritten })
            .collect();
        let overflow = extents.len().saturating_sub(f::INLINE_EXTENTS);
        let need = overflow.div_ceil(f::EXTENTS_PER_BLOCK);
        let (mut grown, mut shrunk) = (0u64, 0u64);
        while node.chain.len() < need {
            let b = self.alloc_meta()?;
            node.chain.push(b);
            grown += 1;
        }
        while node.chain.len() > need {
            let b = node.chain.pop().expect("non-empty");
            self.free_blocks(b, 1, true)?;
            shrunk += 1;
        }
        for i in 0..node.chain.len() {
            let part = &extents[f::INLINE_EXTENTS + i * f::EXTENTS_PER_BLOCK..];
            let part = &part[..part.len().min(f::EXTENTS_PER_BLOCK)];
            let eb = ExtentBlock { ino, next: node.chain.get(i + 1).copied().unwrap_or(0), extents: part.to_vec() };
            eb.encode(self.fresh(node.chain[i]));
        }
        node.d.n_extents = extents.len() as u32;
        node.d.ext_block = node.chain.first().copied().unwrap_or(0);
        if node.d.flags & f::INODE_FLAG_INLINE == 0 {
            node.d.extents = extents[..extents.len().min(f::INLINE_EXTENTS)].to_vec();
        }
        node.d.blocks = node.data_blocks() + node.chain.len() as u64 + node.xattr_blocks;
        let (blk, off) = self.inode_slot(ino);
        let b = self.modify(blk)?;
        node.d.encode(ino, &mut b[off..off + f::INODE_SIZE]);
        node.data_meta_dirty &= keep_data_meta_dirty;
        if node.pins > 0 || !node.reserved.is_empty() || !node.converting.is_empty() {
            node.register(&self.tx, None);
        } else if node.tx_epoch == epoch {
            node.tx_epoch = 0;
        }
        let bitmap = self.sb.block_bitmap_blocks;
        Ok(TxSize::new(need as u64 + grown.min(bitmap) + shrunk.min(bitmap), shrunk))
    }

    /// Allocate an inode number and give it `cell`, a new cell (`InodeCell::blank`, made
    /// before the metadata lock was taken); the inode is stored at commit. Where the
    /// number comes from (`Place`) keeps the inodes of one directory in the same
    /// table blocks and bitmap words, and those of two directories apart: threads
    /// creating in directories of their own then change different cache lines and
    /// blocks (groups of 512 numbers, not 64: 64 bytes of the bitmap, a cache line of
    /// their own; measured in docs/BENCHMARKS.md).
    pub fn new_inode(&mut self, mut cell: Arc<InodeCell>, uid: u32, gid: u32, place: Place) -> Result<u64> {
        if self.ifree == 0 {
            return Err(Error::no_space("no free inodes"));
        }
        let n = self.sb.inode_count;
        let mut i = match place {
            Place::Near(parent) => (parent - 1) % n,
            Place::NewGroup => self.empty_group().unwrap_or(self.ihint),
        };
        while bit(&self.iused, i) {
            let full_word = i.is_multiple_of(64) && i + 64 <= n && self.iused[(i / 64) as usize] == u64::MAX;
            i = (i + if full_word { 64 } else { 1 }) % n;
        }
        // The first inode in use in its table block: the block is initialised now
        // (zeroed in memory, never read), so that mkfs need not zero the table.

        let per = f::INODES_PER_BLOCK;
        let first = i / per * per;
        if (first..(first + per).min(n)).all(|k| !bit(&self.iused, k)) {
            self.fresh(self.inode_slot(i + 1).0);
        }
        self.iused[(i / 64) as usize] |= 1 << (i % 64);
        self.ifree -= 1;
        self.ihint = (i + 1) % n;
        self.set_bitmap(self.sb.inode_bitmap_start, i, true)?;

        let ino = i + 1;
        let t = now();
        let table_block = self.inode_slot(ino).0;
        let c = Arc::get_mut(&mut cell).expect("a blank cell is not shared");
        c.ino = ino;
        c.table_block = table_block;
        let d = &mut c.state_mut().d;
        (d.uid, d.gid, d.nlink) = (uid, gid, 0);
        (d.atime, d.mtime, d.ctime) = (t, t, t);
        // Random, as ext4's (`get_random_u32`): a number used again gets another
        // generation, and no counter shared by the creating threads is written.
        d.generation = rand::random();
        self.table.insert(cell.clone());
        cell.lock().register(&self.tx, None);

        Ok(ino)
    }

    /// The first number of an inode group (`GROUP` numbers, 64 bytes of the bitmap)
    /// with no inode in use, among the next few groups after the last allocation.
    fn empty_group(&self) -> Option<u64> {
        let words = GROUP as usize / 64;
        let groups = self.iused.len() / words;
        if groups == 0 {
            return None;
        }
        let start = (self.ihint / GROUP) as usize + 1;
        (0..groups.min(64))
            .map(|k| (start + k) % groups)
            .find(|g| self.iused[g * words..(g + 1) * words].iter().all(|w| *w == 0))
            .map(|g| g as u64 * GROUP)
    }

    /// Release every block of an inode and its number. The caller has dropped its pages.
    pub fn free_inode(&mut self, ino: u64) -> Result<()> {
        if ino == f::ROOT_INO {
            return Err(Error::corrupt("the root directory is never freed"));
        }
        // Read (and checked) before anything is freed: a corrupt attribute block stops
        // the free with nothing half done.
        let head = self.peek(ino, |node| node.d.xattr_block)?;
        let xattr_blocks = self.xattr_block_list(ino, head)?;
        let node = {
            let mut g = self.inode(ino)?;
            g.freed = true;
            // Out of the transaction (`Tx::forget` below): registering it is no
            // longer a no-op.
            g.tx_epoch = 0;
            g.clone()
        };
        self.table.remove(ino);
        if self.recent[recent_slot(ino)].as_ref().is_some_and(|c| c.ino == ino) {
            *self.recent[recent_slot(ino)] = None;
        }
        self.tx.forget(ino);
        let journaled = node.is_dir() || node.kind() == f::S_IFLNK;
        for run in node.extents.values() {
            self.free_blocks(run.phys, run.len as u64, journaled)?;
        }
        for b in &node.chain {
            self.free_blocks(*b, 1, true)?;
        }
        for b in xattr_blocks {
            self.free_blocks(b, 1, true)?;
        }
        self.add_reserved(-(node.reserved.len() as i64));
        let (blk, off) = self.inode_slot(ino);
        let b = self.modify(blk)?;
        b[off..off + f::INODE_SIZE].fill(0);
        let i = ino - 1;
        self.iused[(i / 64) as usize] &= !(1 << (i % 64));
        self.ifree += 1;
        // The next inode takes this number: its table block is likely in the running
        // transaction already (a create after a delete costs no new block).
        self.ihint = i;
        self.set_bitmap(self.sb.inode_bitmap_start, i, false)?;
        Ok(())
    }

    /// Every in-use inode number (orphan scan at mount, fsck-like walks).
    pub fn used_inodes(&self) -> Vec<u64> {
        (0..self.sb.inode_count).filter(|i| bit(&self.iused, *i)).map(|i| i + 1).collect()
    }

    // ------------------------------------------------------------ directories

    fn dir_slot_block(&mut self, dir: u64, slot: u64) -> Result<(u64, usize)> {
        let lblk = slot / f::DIRENTS_PER_BLOCK as u64;
        let phys = self
            .peek(dir, |node| node.map(lblk))?
            .ok_or_else(|| Error::corrupt(format!("directory {dir}: block {lblk} not mapped")))?;
        Ok((phys, (slot % f::DIRENTS_PER_BLOCK as u64) as usize))
    }

    /// The parent of directory `dir` (ENOTDIR if it is not one).
    pub fn dir_parent(&mut self, dir: u64) -> Result<u64> {
        self.peek(dir, |node| if node.is_dir() { Ok(node.d.parent) } else { Err(Error::not_dir("")) })?
    }

    /// Work on the directory's index (in its cell; built from its blocks on first
    /// use). `f` runs under the index's lock, a leaf: it takes no other lock.
    pub fn dir<T>(&mut self, dir: u64, f: impl FnOnce(&mut DirIndex) -> T) -> Result<T> {
        {
            let Some(names) = &self.cell_ref(dir)?.names else {
                return Err(Error::not_dir(""));
            };
            if let Some(idx) = names.write().as_mut() {
                return Ok(f(idx));
            }
        }
        let cell = self.cell(dir)?;
        let names = cell.names.as_ref().expect("a directory's cell, as checked above");
        let nblocks = cell.lock().d.size / BLOCK;
        let mut idx =
            DirIndex { names: HashMap::new(), free: BTreeSet::new(), slots: nblocks * f::DIRENTS_PER_BLOCK as u64 };
        for l in 0..nblocks {
            let (phys, _) = self.dir_slot_block(dir, l * f::DIRENTS_PER_BLOCK as u64)?;
            let entries = f::dir_block_decode(dir, self.sealed(phys)?)?;
            for (i, e) in entries.into_iter().enumerate() {
                let slot = l * f::DIRENTS_PER_BLOCK as u64 + i as u64;
                match e {
                    Some(e) => {
                        if idx.names.insert(e.name, (slot, e.ino)).is_some() {
                            return Err(Error::corrupt(format!("directory {dir}: duplicate name")));
                        }
                    }
                    None => {
                        idx.free.insert(slot);
                    }
                }
            }
        }
        // Loads happen under the metadata lock only: nobody filled it meanwhile.
        let mut names = names.write();
        Ok(f(names.insert(idx)))
    }

    /// `dir` for a change that takes a name away from its inode: counted in the
    /// directory's `names_gen` once made (after the index's lock is released), so that a
    /// lookup which read the count before it sees the change by the count.
    fn dir_unmap<T>(&mut self, dir: u64, f: impl FnOnce(&mut DirIndex) -> T) -> Result<T> {
        let v = self.dir(dir, f)?;
        self.cell_ref(dir)?.names_gen.fetch_add(1, std::sync::atomic::Ordering::Release);
        Ok(v)
    }

    /// Every slot of directory block `lblk`.
    pub fn dir_block_entries(&mut self, dir: u64, lblk: u64) -> Result<Vec<Option<f::Dirent>>> {
        let (phys, _) = self.dir_slot_block(dir, lblk * f::DIRENTS_PER_BLOCK as u64)?;
        Ok(f::dir_block_decode(dir, self.sealed(phys)?)?)
    }

    /// The inode `name` names in `dir`, and its slot.
    pub fn lookup(&mut self, dir: u64, name: &[u8]) -> Result<Option<(u64, u64)>> {
        self.dir(dir, |idx| idx.names.get(name).map(|(slot, ino)| (*ino, *slot)))
    }

    /// Add `name → ino` to `dir` (the caller checked that the name is absent).
    pub fn dir_add(&mut self, dir: u64, name: &[u8], ino: u64, ftype: u8) -> Result<()> {
        let slot = match self.dir(dir, |idx| idx.free.pop_first())? {
            Some(s) => s,
            None => {
                // Grow the directory by one block.
                let b = self.alloc_meta()?;
                f::dir_block_init(dir, self.fresh(b));
                let tx = self.tx.clone();
                let mut node = self.inode(dir)?;
                let lblk = node.d.size / BLOCK;
                node.add_mapping(lblk, b, 1);
                node.d.size += BLOCK;
                node.register(&tx, None);
                drop(node);
                self.dir(dir, |idx| {
                    let first = idx.slots;
                    idx.slots += f::DIRENTS_PER_BLOCK as u64;
                    idx.free.extend(first + 1..idx.slots);
                    first
                })?
            }
        };
        let (phys, i) = self.dir_slot_block(dir, slot)?;
        let b = self.modify(phys)?;
        f::dirent_put(b, i, Some(&f::Dirent { ino, ftype, name: name.to_vec() }));
        self.unsealed.insert(phys);
        self.dir(dir, |idx| idx.names.insert(name.to_vec(), (slot, ino)))?;
        Ok(())
    }

    pub fn dir_remove(&mut self, dir: u64, name: &[u8]) -> Result<()> {
        let (slot, _) = self.dir_unmap(dir, |idx| idx.names.remove(name))?.ok_or_else(|| Error::not_found(""))?;
        let (phys, i) = self.dir_slot_block(dir, slot)?;
        let b = self.modify(phys)?;
        f::dirent_put(b, i, None);
        self.unsealed.insert(phys);
        self.dir(dir, |idx| idx.free.insert(slot))?;
        Ok(())
    }

    /// Point an existing entry at another inode (rename over an existing name).
    pub fn dir_replace(&mut self, dir: u64, name: &[u8], ino: u64, ftype: u8) -> Result<()> {
        let slot = self
            .dir_unmap(dir, |idx| idx.names.get_mut(name).map(|e| std::mem::replace(e, (e.0, ino)).0))?
            .ok_or_else(|| Error::not_found(""))?;
        let (phys, i) = self.dir_slot_block(dir, slot)?;
        let b = self.modify(phys)?;
        f::dirent_put(b, i, Some(&f::Dirent { ino, ftype, name: name.to_vec() }));
        self.unsealed.insert(phys);
        Ok(())
    }

    pub fn dir_is_empty(&mut self, dir: u64) -> Result<bool> {
        self.dir(dir, |idx| idx.names.is_empty())
    }

    /// The blocks holding the extended attributes whose head is `head` (0: none):
    /// the head, then its continuation blocks.
    fn xattr_block_list(&mut self, ino: u64, head: u64) -> Result<Vec<u64>> {
        if head == 0 {
            return Ok(Vec::new());
        }
        let (start, end) = (self.sb.data_start, self.sb.data_end);
        let in_data = |b: u64| b >= start && b < end;
        if !in_data(head) {
            return Err(Error::corrupt(format!("inode {ino}: xattr block {head} outside the data area")));
        }
        let mut list = vec![head];
        if let f::XattrHead::Chained { conts, .. } = f::xattr_decode_head(self.block(head)?, ino)? {
            if let Some(b) = conts.iter().find(|b| !in_data(**b)) {
                return Err(Error::corrupt(format!("inode {ino}: xattr block {b} outside the data area")));
            }
            list.extend(conts);
        }
        Ok(list)
    }

    /// The extended attributes of `ino` (sorted by name).
    pub fn xattrs(&mut self, ino: u64) -> Result<f::Xattrs> {
        let head = self.peek(ino, |node| node.d.xattr_block)?;
        if head == 0 {
            return Ok(Vec::new());
        }
        let list = self.xattr_block_list(ino, head)?;
        match f::xattr_decode_head(self.block(head)?, ino)? {
            f::XattrHead::Legacy(entries) => Ok(entries),
            f::XattrHead::Chained { count, part, .. } => {
                let mut stream = part;
                for (i, b) in list.iter().enumerate().skip(1) {
                    stream.extend_from_slice(f::xattr_decode_cont(self.block(*b)?, ino, i)?);
                }
                Ok(f::xattr_parse(&stream, count)?)
            }
        }
    }

    /// What replacing the extended attributes of `ino` with `entries` adds to the
    /// running transaction: the inode, every block written, the bitmap blocks of those
    /// allocated or freed, and a revoke for each freed one. ENOSPC if they do not fit
    /// the blocks an inode may use for them.
    pub fn xattr_cost(&mut self, ino: u64, entries: &[(Vec<u8>, Vec<u8>)]) -> Result<(TxSize, u64)> {
        let new = match entries.is_empty() {
            true => 0,
            false => f::xattr_blocks_for(entries)
                .ok_or_else(|| Error::no_space("no room for more extended attributes on this inode"))?
                as u64,
        };
        let old = self.inode(ino)?.xattr_blocks;
        let changed = new.abs_diff(old);
        let bitmaps = changed.min(self.sb.block_bitmap_blocks);
        let tx = self.inode_cost(ino, 0)?.plus(TxSize::new(new + bitmaps, old.saturating_sub(new)));
        Ok((tx, new.saturating_sub(old)))
    }

    /// Replace the extended attributes of `ino` (the caller checked they fit with
    /// `xattr_cost`). Their blocks are reused in order, more allocated or the rest freed.
    pub fn set_xattrs(&mut self, ino: u64, entries: f::Xattrs) -> Result<()> {
        let head = self.inode(ino)?.d.xattr_block;
        let mut old = self.xattr_block_list(ino, head)?;
        let n = match entries.is_empty() {
            true => 0,
            false => f::xattr_blocks_for(&entries).ok_or_else(|| Error::no_space("extended attributes too large"))?,
        };
        let mut blocks: Vec<(u64, bool)> = old.iter().take(n).map(|b| (*b, false)).collect();
        while blocks.len() < n {
            blocks.push((self.alloc_meta()?, true));
        }
        for b in old.drain(n.min(old.len())..) {
            self.free_blocks(b, 1, true)?;
        }
        if n > 0 {
            let at: Vec<u64> = blocks.iter().map(|(b, _)| *b).collect();
            for ((b, fresh), image) in blocks.iter().zip(f::xattr_encode(ino, &entries, &at)) {
                let buf = if *fresh { self.fresh(*b) } else { self.modify(*b)? };
                buf.copy_from_slice(&image);
            }
        }
        let first = blocks.first().map(|(b, _)| *b).unwrap_or(0);
        self.update(ino, |node| {
            node.d.xattr_block = first;
            node.xattr_blocks = n as u64;
            node.d.ctime = now();
        })
    }

    /// Symlink target or other small journaled payload stored in one block.
    pub fn write_payload_block(&mut self, data: &[u8]) -> Result<u64> {
        let b = self.alloc_meta()?;
        let buf = self.fresh(b);
        buf[..data.len()].copy_from_slice(data);
        Ok(b)
    }

    pub fn read_payload_block(&mut self, b: u64, len: usize) -> Result<Vec<u8>> {
        Ok(self.block(b)?[..len].to_vec())
    }
}
