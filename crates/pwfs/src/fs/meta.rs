//! Metadata state of a mounted file system: cached metadata blocks, the running
//! transaction, loaded inodes, directory indexes, and the allocators.
//!
//! Everything here is guarded by one mutex (`Fs::meta`) and is never held across
//! data I/O; it does read metadata blocks on a miss. Every change to a metadata block
//! goes through [`Meta::modify`], which puts the block in the running transaction;
//! [`Meta::take_tx`] turns the transaction into journal images.

use crate::alloc::Allocator;
use crate::device::{AlignedBuf, Device};
use crate::error::{Error, Result};
use crate::format::{self as f, DiskInode, Extent, ExtentBlock, Superblock, Timespec, BLOCK, BLOCK_SIZE};
use crate::journal::Transaction;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// An inode in memory. Extents map file block → (length, device block).
#[derive(Debug, Clone)]
pub struct Inode {
    pub d: DiskInode,
    pub extents: BTreeMap<u32, (u32, u64)>,
    /// Blocks of the on-disk extent chain, in order.
    pub chain: Vec<u64>,
    /// Pages with space reserved for delayed allocation (written, not yet mapped).
    pub reserved: BTreeSet<u64>,
}

impl Inode {
    pub fn kind(&self) -> u32 {
        self.d.mode & f::S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.kind() == f::S_IFDIR
    }

    /// Device block of file block `lblk`, if mapped.
    pub fn map(&self, lblk: u64) -> Option<u64> {
        let (start, (len, phys)) = self.extents.range(..=lblk as u32).next_back()?;
        let off = lblk - *start as u64;
        (off < *len as u64).then(|| phys + off)
    }

    /// Extent-chain blocks this inode needs once its reserved pages are mapped (each
    /// may become an extent of its own).
    pub fn chain_needed(&self) -> u64 {
        if self.d.flags & f::INODE_FLAG_INLINE != 0 {
            return 0;
        }
        let extents = self.extents.len() + self.reserved.len();
        extents.saturating_sub(f::INLINE_EXTENTS).div_ceil(f::EXTENTS_PER_BLOCK) as u64
    }

    /// Number of data blocks mapped.
    pub fn data_blocks(&self) -> u64 {
        self.extents.values().map(|(l, _)| *l as u64).sum()
    }

    /// Add a mapping, merging with the previous extent when contiguous.
    pub fn add_mapping(&mut self, lblk: u64, phys: u64, len: u64) {
        if let Some((start, (l, p))) = self.extents.range_mut(..lblk as u32).next_back() {
            if *start as u64 + *l as u64 == lblk && *p + *l as u64 == phys && *l as u64 + len <= u32::MAX as u64 {
                *l += len as u32;
                return;
            }
        }
        self.extents.insert(lblk as u32, (len as u32, phys));
    }

    /// Remove every mapping at or past `from`; returns the freed device runs.
    pub fn unmap_from(&mut self, from: u64) -> Vec<(u64, u64)> {
        self.unmap_range(from, u32::MAX as u64 + 1)
    }

    /// Remove the mappings of file blocks `from..to`; returns the freed device runs.
    pub fn unmap_range(&mut self, from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut freed = Vec::new();
        let mut split = Vec::new();
        let keys: Vec<u32> = match u32::try_from(to) {
            Ok(to) => self.extents.range(..to).map(|(k, _)| *k).collect(),
            Err(_) => self.extents.keys().copied().collect(),
        };
        for k in keys.into_iter().rev() {
            let (len, phys) = self.extents[&k];
            let (start, end) = (k as u64, k as u64 + len as u64);
            if end <= from {
                break;
            }
            self.extents.remove(&k);
            let (cut_from, cut_to) = (start.max(from), end.min(to));
            freed.push((phys + (cut_from - start), cut_to - cut_from));
            if start < cut_from {
                split.push((start, phys, cut_from - start));
            }
            if cut_to < end {
                split.push((cut_to, phys + (cut_to - start), end - cut_to));
            }
        }
        for (l, p, n) in split {
            self.extents.insert(l as u32, (n as u32, p));
        }
        freed
    }
}

/// In-memory index of one directory: name → slot, and the free slots.
pub struct DirIndex {
    pub names: HashMap<Vec<u8>, u64>,
    pub free: BTreeSet<u64>,
    pub slots: u64,
}

pub struct Meta {
    pub sb: Superblock,
    dev: Arc<dyn Device>,
    blocks: HashMap<u64, AlignedBuf>,
    tx_dirty: BTreeSet<u64>,
    tx_revokes: BTreeSet<u64>,
    /// Committed since the last checkpoint: the cached copy is newer than home.
    pub pinned: HashSet<u64>,
    pub inodes: HashMap<u64, Inode>,
    dirty_inodes: BTreeSet<u64>,
    /// Dirty inodes whose extents (with reserved pages) overflow the inode: storing
    /// them rewrites an extent chain, which the transaction's size must count.
    chained: BTreeSet<u64>,
    dirs: HashMap<u64, DirIndex>,
    pub alloc: Allocator,
    /// Blocks promised to delayed allocations.
    pub reserved: u64,
    /// Room in the running transaction promised to operations that were admitted
    /// and change metadata later, after I/O without this lock (truncate).
    pub credits: TxSize,
    iused: Vec<u64>,
    pub ifree: u64,
    ihint: u64,
    /// Open handles per inode (an unlinked inode lives until the last one closes).
    pub open: HashMap<u64, u32>,
    /// Unlinked inodes with no open handle; freed at the start of the next commit.
    pub to_free: BTreeSet<u64>,
    /// Inodes whose size or block mapping changed since the last commit: fdatasync
    /// of one of these must commit; of any other it need only write data and flush.
    pub data_meta_dirty: HashSet<u64>,
    block_limit: usize,
    pub generation_seed: u32,
}

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

/// What storing a dirty inode's extent chain adds to its transaction: every chain
/// block it keeps is rewritten, a new one also changes a bitmap block, a dropped one
/// is freed (a bitmap block) and revoked.
fn chain_cost(node: &Inode, bitmap_blocks: u64) -> (u64, u64) {
    chain_cost_of(node, 0, bitmap_blocks)
}

/// `chain_cost` once the inode has gained `extra` extents. Reserved pages may or may
/// not have become extents when it is stored: the chain may grow to hold all of them
/// or shrink to hold only the extents mapped now.
fn chain_cost_of(node: &Inode, extra: u64, bitmap_blocks: u64) -> (u64, u64) {
    if node.d.flags & f::INODE_FLAG_INLINE != 0 {
        return (0, 0);
    }
    let blocks = |extents: u64| extents.saturating_sub(f::INLINE_EXTENTS as u64).div_ceil(f::EXTENTS_PER_BLOCK as u64);
    let most = blocks(node.extents.len() as u64 + node.reserved.len() as u64 + extra);
    let least = blocks(node.extents.len() as u64);
    let have = node.chain.len() as u64;
    let (grow, shrink) = (most.saturating_sub(have), have.saturating_sub(least));
    (most + grow.min(bitmap_blocks) + shrink.min(bitmap_blocks), shrink)
}

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
    pub fn load(sb: Superblock, dev: Arc<dyn Device>, preloaded: BTreeMap<u64, Vec<u8>>) -> Result<Meta> {
        let mut m = Meta {
            alloc: Allocator::new(sb.data_start, sb.data_blocks()),
            iused: vec![0; sb.inode_count.div_ceil(64) as usize],
            ifree: sb.inode_count,
            ihint: 0,
            sb,
            dev,
            blocks: HashMap::new(),
            tx_dirty: BTreeSet::new(),
            tx_revokes: BTreeSet::new(),
            pinned: HashSet::new(),
            inodes: HashMap::new(),
            dirty_inodes: BTreeSet::new(),
            chained: BTreeSet::new(),
            dirs: HashMap::new(),
            reserved: 0,
            credits: TxSize::default(),
            open: HashMap::new(),
            to_free: BTreeSet::new(),
            data_meta_dirty: HashSet::new(),
            block_limit: 16384,
            generation_seed: rand::random(),
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

    /// The block, made part of the running transaction.
    pub fn modify(&mut self, b: u64) -> Result<&mut AlignedBuf> {
        self.tx_dirty.insert(b);
        self.tx_revokes.remove(&b);
        self.block(b)
    }

    /// A freshly allocated metadata block: zeroed, in the transaction, not read.
    fn fresh(&mut self, b: u64) -> &mut AlignedBuf {
        self.tx_dirty.insert(b);
        self.tx_revokes.remove(&b);
        let buf = self.dev.alloc_zeroed(BLOCK_SIZE);
        self.blocks.insert(b, buf);
        self.blocks.get_mut(&b).expect("just inserted")
    }

    fn shrink(&mut self) {
        if self.blocks.len() < self.block_limit {
            return;
        }
        let (dirty, pinned) = (&self.tx_dirty, &self.pinned);
        let mut n = self.blocks.len() / 2;
        self.blocks.retain(|b, _| {
            if n > 0 && !dirty.contains(b) && !pinned.contains(b) {
                n -= 1;
                return false;
            }
            true
        });
    }

    /// The size of the running transaction if it were committed now, counted as
    /// distinct blocks: every block changed so far (inode table blocks join when an
    /// inode is marked dirty), plus what closing it may still add — extent chains of
    /// dirty inodes (rewritten whole, new chain blocks allocated) and the bitmap blocks
    /// that write-back of reserved pages will change. An upper bound, exact for
    /// everything already changed; `take_tx` asserts that the real one is not larger.
    pub fn tx_size(&self) -> TxSize {
        let mut size = TxSize { images: self.tx_dirty.len() as u64, revokes: self.tx_revokes.len() as u64 };
        for ino in &self.chained {
            if let Some(node) = self.inodes.get(ino) {
                let (write, revoke) = chain_cost(node, self.sb.block_bitmap_blocks);
                size.images += write;
                size.revokes += revoke;
            }
        }
        size.images += self.reserved.min(self.sb.block_bitmap_blocks);
        size.plus(self.credits)
    }

    /// At most what marking `ino` dirty adds to the running transaction once it has
    /// gained `extra` extents: its table block and its whole extent chain.
    pub fn inode_cost(&mut self, ino: u64, extra: u64) -> Result<TxSize> {
        let bitmap = self.sb.block_bitmap_blocks;
        let (images, revokes) = chain_cost_of(self.inode(ino)?, extra, bitmap);
        Ok(TxSize::new(1 + images, revokes))
    }

    /// At most the bitmap blocks that freeing the mappings of `ino` at and past file
    /// block `from` changes.
    pub fn unmap_cost(&mut self, ino: u64, from: u64) -> Result<u64> {
        let bitmap = self.sb.block_bitmap_blocks;
        let node = self.inode(ino)?;
        let mut n = 0u64;
        for (start, (len, _)) in node.extents.iter().rev() {
            if (*start as u64 + *len as u64) <= from {
                break;
            }
            n += (*len as u64).div_ceil(f::BITS_PER_BITMAP_BLOCK) + 1;
            if n >= bitmap {
                return Ok(bitmap);
            }
        }
        Ok(n)
    }

    /// At most what freeing `ino` (`free_inode`) adds to the running transaction.
    pub fn free_cost(&mut self, ino: u64) -> Result<TxSize> {
        let bitmap = self.sb.block_bitmap_blocks;
        let spans = self.unmap_cost(ino, 0)?;
        let node = self.inode(ino)?;
        let journaled = node.is_dir() || node.kind() == f::S_IFLNK;
        let meta_blocks = node.chain.len() as u64 + (node.d.xattr_block != 0) as u64;
        let revokes = meta_blocks + if journaled { node.data_blocks() } else { 0 };
        // Table block, inode bitmap block, block bitmap blocks.
        Ok(TxSize::new(2 + (spans + meta_blocks).min(bitmap), revokes))
    }

    /// Free part of an inode too large to free in one transaction of at most
    /// `room` log blocks: unmap its last extents while they fit (its blocks are
    /// freed, the inode keeps the rest and stays unlinked). Returns whether anything
    /// was unmapped.
    pub fn trim_inode(&mut self, ino: u64, room: u64) -> Result<bool> {
        let journaled = {
            let node = self.inode(ino)?;
            node.is_dir() || node.kind() == f::S_IFLNK
        };
        let mut trimmed = false;
        loop {
            let base = self.tx_size().plus(self.inode_cost(ino, 0)?);
            let node = self.inode(ino)?;
            let Some((&start, &(len, _))) = node.extents.iter().next_back() else { break };
            // Split a long extent so that one piece always fits.
            let len = len as u64;
            let piece = if journaled { len.min(f::JDESC_ENTRIES as u64) } else { len };
            let cost = TxSize::new(piece.div_ceil(f::BITS_PER_BITMAP_BLOCK) + 1, if journaled { piece } else { 0 });
            if base.plus(cost).log_blocks() > room {
                break;
            }
            let from = start as u64 + len - piece;
            let freed = self.inode(ino)?.unmap_range(from, start as u64 + len);
            for (b, n) in freed {
                self.free_blocks(b, n, journaled)?;
            }
            self.mark_inode_dirty(ino);
            trimmed = true;
        }
        Ok(trimmed)
    }

    /// Whether nothing has changed since the last commit.
    pub fn tx_is_empty(&self) -> bool {
        self.tx_dirty.is_empty() && self.tx_revokes.is_empty() && self.dirty_inodes.is_empty()
    }

    /// Close the running transaction: write dirty inodes into their blocks and hand
    /// out copies of every changed block, the revokes, and the frees to release once
    /// it is durable.
    pub fn take_tx(&mut self) -> Result<(Transaction, Vec<(u64, u64)>)> {
        let bound = self.tx_size();
        for ino in std::mem::take(&mut self.dirty_inodes) {
            self.store_inode(ino)?;
        }
        self.chained.clear();
        let dirty = std::mem::take(&mut self.tx_dirty);
        let mut images = Vec::with_capacity(dirty.len());
        for b in dirty {
            let mut copy = self.dev.alloc(BLOCK_SIZE);
            copy.copy_from_slice(self.block(b)?);
            self.check_before_write(b, &copy)?;
            images.push((b, copy));
        }
        let revokes: Vec<u64> = std::mem::take(&mut self.tx_revokes).into_iter().collect();
        // Paired with `tx_size`: operations are admitted against that bound, so a
        // transaction larger than it could outgrow the journal.
        if images.len() as u64 > bound.images || revokes.len() as u64 > bound.revokes {
            return Err(Error::corrupt(format!(
                "bug: transaction of {} images and {} revokes, counted as at most {} and {}",
                images.len(),
                revokes.len(),
                bound.images,
                bound.revokes
            )));
        }
        self.data_meta_dirty.clear();
        let frees = self.alloc.take_pending();
        Ok((Transaction { images, revokes, extra: Vec::new() }, frees))
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
        f::bitmap_seal(b, blk);
        Ok(())
    }

    /// Set or clear the bits of a run of blocks, sealing each bitmap block once.
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
            f::bitmap_seal(buf, blk);
            b = end;
        }
        Ok(())
    }

    /// Free blocks a caller may still promise (allocator free minus reservations).
    pub fn available(&self) -> u64 {
        self.alloc.free_blocks().saturating_sub(self.reserved)
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
        self.mark_blocks(first, count, false)?;
        self.alloc.free(first, count);
        for b in first..first + count {
            if journaled {
                self.tx_dirty.remove(&b);
                self.tx_revokes.insert(b);
                self.pinned.remove(&b);
            }
            self.blocks.remove(&b);
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

    pub fn inode(&mut self, ino: u64) -> Result<&mut Inode> {
        if !self.inodes.contains_key(&ino) {
            if !self.valid_ino(ino) {
                return Err(Error::not_found(format!("inode {ino} is not in use")));
            }
            let node = self.load_inode(ino)?;
            self.inodes.insert(ino, node);
        }
        Ok(self.inodes.get_mut(&ino).expect("loaded"))
    }

    fn load_inode(&mut self, ino: u64) -> Result<Inode> {
        let (blk, off) = self.inode_slot(ino);
        let b = self.block(blk)?;
        let d = DiskInode::decode(ino, &b[off..off + f::INODE_SIZE])?
            .ok_or_else(|| Error::corrupt(format!("inode {ino} is marked in use but its slot is empty")))?;
        let mut node = Inode { extents: BTreeMap::new(), chain: Vec::new(), reserved: BTreeSet::new(), d };
        let mut all: Vec<Extent> = node.d.extents.clone();
        let mut next = node.d.ext_block;
        while next != 0 {
            if node.chain.len() as u64 > node.d.n_extents as u64 / f::EXTENTS_PER_BLOCK as u64 + 1
                || next < self.sb.data_start
                || next >= self.sb.data_end
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
            if e.len == 0 || e.physical < self.sb.data_start || e.physical + e.len as u64 > self.sb.data_end {
                return Err(Error::corrupt(format!("inode {ino}: extent outside the data area")));
            }
            node.extents.insert(e.logical, (e.len, e.physical));
        }
        Ok(node)
    }

    /// The inode goes into the running transaction: its table block now (so that the
    /// transaction's size counts distinct blocks), its slot and extents when it closes.
    /// Every change to an inode's extents or reserved pages is followed by this call.
    pub fn mark_inode_dirty(&mut self, ino: u64) {
        self.dirty_inodes.insert(ino);
        let blk = self.inode_slot(ino).0;
        self.tx_dirty.insert(blk);
        if self.inodes.get(&ino).is_some_and(|n| n.chain_needed() > 0 || !n.chain.is_empty()) {
            self.chained.insert(ino);
        }
    }

    /// Write an inode (and its extent chain) into the cached metadata blocks.
    fn store_inode(&mut self, ino: u64) -> Result<()> {
        let Some(node) = self.inodes.get(&ino) else {
            return Ok(());
        };
        let mut node = node.clone();
        let extents: Vec<Extent> =
            node.extents.iter().map(|(l, (n, p))| Extent { logical: *l, len: *n, physical: *p }).collect();
        let overflow = extents.len().saturating_sub(f::INLINE_EXTENTS);
        let need = overflow.div_ceil(f::EXTENTS_PER_BLOCK);
        while node.chain.len() < need {
            let b = self.alloc_meta()?;
            node.chain.push(b);
        }
        while node.chain.len() > need {
            let b = node.chain.pop().expect("non-empty");
            self.free_blocks(b, 1, true)?;
        }
        for (i, blk) in node.chain.iter().enumerate() {
            let part = &extents[f::INLINE_EXTENTS + i * f::EXTENTS_PER_BLOCK..];
            let part = &part[..part.len().min(f::EXTENTS_PER_BLOCK)];
            let eb = ExtentBlock { ino, next: node.chain.get(i + 1).copied().unwrap_or(0), extents: part.to_vec() };
            eb.encode(self.fresh(*blk));
        }
        node.d.n_extents = extents.len() as u32;
        node.d.ext_block = node.chain.first().copied().unwrap_or(0);
        if node.d.flags & f::INODE_FLAG_INLINE == 0 {
            node.d.extents = extents[..extents.len().min(f::INLINE_EXTENTS)].to_vec();
        }
        node.d.blocks = node.data_blocks() + node.chain.len() as u64 + (node.d.xattr_block != 0) as u64;
        let (blk, off) = self.inode_slot(ino);
        let b = self.modify(blk)?;
        node.d.encode(ino, &mut b[off..off + f::INODE_SIZE]);
        self.inodes.insert(ino, node);
        Ok(())
    }

    /// Allocate an inode number and a fresh in-memory inode (stored at commit).
    pub fn new_inode(&mut self, mode: u32, uid: u32, gid: u32) -> Result<u64> {
        if self.ifree == 0 {
            return Err(Error::no_space("no free inodes"));
        }
        let n = self.sb.inode_count;
        let mut i = self.ihint;
        while bit(&self.iused, i) {
            i = (i + 1) % n;
        }
        self.iused[(i / 64) as usize] |= 1 << (i % 64);
        self.ifree -= 1;
        self.ihint = (i + 1) % n;
        self.set_bitmap(self.sb.inode_bitmap_start, i, true)?;
        let ino = i + 1;
        let t = now();
        self.generation_seed = self.generation_seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
        let d = DiskInode {
            mode,
            uid,
            gid,
            nlink: 0,
            atime: t,
            mtime: t,
            ctime: t,
            generation: self.generation_seed,
            ..Default::default()
        };
        self.inodes.insert(ino, Inode { d, extents: BTreeMap::new(), chain: Vec::new(), reserved: BTreeSet::new() });
        self.mark_inode_dirty(ino);
        Ok(ino)
    }

    /// Release every block of an inode and its number. The caller has dropped its pages.
    pub fn free_inode(&mut self, ino: u64) -> Result<()> {
        let node = self.inode(ino)?.clone();
        let journaled = node.is_dir() || node.kind() == f::S_IFLNK;
        for (_, (len, phys)) in node.extents.iter() {
            self.free_blocks(*phys, *len as u64, journaled)?;
        }
        for b in &node.chain {
            self.free_blocks(*b, 1, true)?;
        }
        if node.d.xattr_block != 0 {
            self.free_blocks(node.d.xattr_block, 1, true)?;
        }
        self.reserved -= node.reserved.len() as u64;
        self.inodes.remove(&ino);
        self.dirty_inodes.remove(&ino);
        self.chained.remove(&ino);
        self.dirs.remove(&ino);
        let (blk, off) = self.inode_slot(ino);
        let b = self.modify(blk)?;
        b[off..off + f::INODE_SIZE].fill(0);
        let i = ino - 1;
        self.iused[(i / 64) as usize] &= !(1 << (i % 64));
        self.ifree += 1;
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
            .inode(dir)?
            .map(lblk)
            .ok_or_else(|| Error::corrupt(format!("directory {dir}: block {lblk} not mapped")))?;
        Ok((phys, (slot % f::DIRENTS_PER_BLOCK as u64) as usize))
    }

    /// The directory's index, built from its blocks on first use.
    pub fn dir(&mut self, dir: u64) -> Result<&mut DirIndex> {
        if !self.dirs.contains_key(&dir) {
            let node = self.inode(dir)?;
            if !node.is_dir() {
                return Err(Error::not_dir(""));
            }
            let nblocks = node.d.size / BLOCK;
            let mut idx =
                DirIndex { names: HashMap::new(), free: BTreeSet::new(), slots: nblocks * f::DIRENTS_PER_BLOCK as u64 };
            for l in 0..nblocks {
                let (phys, _) = self.dir_slot_block(dir, l * f::DIRENTS_PER_BLOCK as u64)?;
                let entries = f::dir_block_decode(dir, self.block(phys)?)?;
                for (i, e) in entries.into_iter().enumerate() {
                    let slot = l * f::DIRENTS_PER_BLOCK as u64 + i as u64;
                    match e {
                        Some(e) => {
                            if idx.names.insert(e.name, slot).is_some() {
                                return Err(Error::corrupt(format!("directory {dir}: duplicate name")));
                            }
                        }
                        None => {
                            idx.free.insert(slot);
                        }
                    }
                }
            }
            self.dirs.insert(dir, idx);
        }
        Ok(self.dirs.get_mut(&dir).expect("loaded"))
    }

    /// Every slot of directory block `lblk`.
    pub fn dir_block_entries(&mut self, dir: u64, lblk: u64) -> Result<Vec<Option<f::Dirent>>> {
        let (phys, _) = self.dir_slot_block(dir, lblk * f::DIRENTS_PER_BLOCK as u64)?;
        Ok(f::dir_block_decode(dir, self.block(phys)?)?)
    }

    pub fn dir_entry(&mut self, dir: u64, slot: u64) -> Result<Option<f::Dirent>> {
        let (phys, i) = self.dir_slot_block(dir, slot)?;
        let b = self.block(phys)?;
        Ok(f::dir_block_decode(dir, b)?.swap_remove(i))
    }

    pub fn lookup(&mut self, dir: u64, name: &[u8]) -> Result<Option<(u64, u64)>> {
        let slot = match self.dir(dir)?.names.get(name) {
            Some(s) => *s,
            None => return Ok(None),
        };
        let e = self.dir_entry(dir, slot)?.ok_or_else(|| Error::corrupt("directory index out of date"))?;
        Ok(Some((e.ino, slot)))
    }

    /// Add `name → ino` to `dir` (the caller checked that the name is absent).
    pub fn dir_add(&mut self, dir: u64, name: &[u8], ino: u64, ftype: u8) -> Result<()> {
        let slot = match self.dir(dir)?.free.pop_first() {
            Some(s) => s,
            None => {
                // Grow the directory by one block.
                let b = self.alloc_meta()?;
                f::dir_block_init(dir, self.fresh(b));
                let node = self.inode(dir)?;
                let lblk = node.d.size / BLOCK;
                node.add_mapping(lblk, b, 1);
                node.d.size += BLOCK;
                self.mark_inode_dirty(dir);
                let idx = self.dir(dir)?;
                let first = idx.slots;
                idx.slots += f::DIRENTS_PER_BLOCK as u64;
                idx.free.extend(first + 1..idx.slots);
                first
            }
        };
        let (phys, i) = self.dir_slot_block(dir, slot)?;
        let b = self.modify(phys)?;
        f::dirent_put(b, i, Some(&f::Dirent { ino, ftype, name: name.to_vec() }));
        f::dir_block_seal(b);
        self.dir(dir)?.names.insert(name.to_vec(), slot);
        Ok(())
    }

    pub fn dir_remove(&mut self, dir: u64, name: &[u8]) -> Result<()> {
        let slot = self.dir(dir)?.names.remove(name).ok_or_else(|| Error::not_found(""))?;
        let (phys, i) = self.dir_slot_block(dir, slot)?;
        let b = self.modify(phys)?;
        f::dirent_put(b, i, None);
        f::dir_block_seal(b);
        self.dir(dir)?.free.insert(slot);
        Ok(())
    }

    /// Point an existing entry at another inode (rename over an existing name).
    pub fn dir_replace(&mut self, dir: u64, name: &[u8], ino: u64, ftype: u8) -> Result<()> {
        let slot = *self.dir(dir)?.names.get(name).ok_or_else(|| Error::not_found(""))?;
        let (phys, i) = self.dir_slot_block(dir, slot)?;
        let b = self.modify(phys)?;
        f::dirent_put(b, i, Some(&f::Dirent { ino, ftype, name: name.to_vec() }));
        f::dir_block_seal(b);
        Ok(())
    }

    pub fn dir_is_empty(&mut self, dir: u64) -> Result<bool> {
        Ok(self.dir(dir)?.names.is_empty())
    }

    /// The extended attributes of `ino` (sorted by name).
    pub fn xattrs(&mut self, ino: u64) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let b = self.inode(ino)?.d.xattr_block;
        if b == 0 {
            return Ok(Vec::new());
        }
        if b < self.sb.data_start || b >= self.sb.data_end {
            return Err(Error::corrupt(format!("inode {ino}: xattr block {b} outside the data area")));
        }
        let x = f::XattrBlock::decode(self.block(b)?)?;
        if x.ino != ino {
            return Err(Error::corrupt(format!("inode {ino}: xattr block {b} belongs to inode {}", x.ino)));
        }
        Ok(x.entries)
    }

    /// Replace the extended attributes of `ino` (the caller checked they fit a block).
    pub fn set_xattrs(&mut self, ino: u64, entries: Vec<(Vec<u8>, Vec<u8>)>) -> Result<()> {
        let old = self.inode(ino)?.d.xattr_block;
        if entries.is_empty() {
            if old != 0 {
                self.free_blocks(old, 1, true)?;
                self.inode(ino)?.d.xattr_block = 0;
            }
        } else {
            let b = if old != 0 { old } else { self.alloc_meta()? };
            let x = f::XattrBlock { ino, entries };
            if old != 0 {
                x.encode(self.modify(b)?);
            } else {
                x.encode(self.fresh(b));
            }
            self.inode(ino)?.d.xattr_block = b;
        }
        self.inode(ino)?.d.ctime = now();
        self.mark_inode_dirty(ino);
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn node(extents: &[(u32, u32, u64)]) -> Inode {
        let mut n =
            Inode { d: DiskInode::default(), extents: BTreeMap::new(), chain: Vec::new(), reserved: BTreeSet::new() };
        for (l, len, p) in extents {
            n.extents.insert(*l, (*len, *p));
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
}
