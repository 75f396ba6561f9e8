//! space: fallocate(2) — preallocation, punching holes, zeroing, collapsing and
//! inserting ranges — and lseek(2)'s SEEK_DATA/SEEK_HOLE.
//!
//! Preallocated blocks are *unwritten* (as ext4's): allocated and journaled like any
//! block, read as zeros, and marked written by the write-back that first writes a page
//! of them, in the transaction that this write-back precedes (ordered mode, as for a
//! new allocation). So a crash never shows a preallocated block's old contents.
//!
//! Interface: `Fs::fallocate(ino, mode, offset, len)` with the FALLOC_FL_* bits of
//! Linux, and `Fs::seek_hole_data(ino, offset, hole)`. Every mode is one transaction
//! per piece (a preallocation is admitted a piece at a time, so it never outgrows the
//! journal); the data-changing modes hold the file's access lock throughout and the
//! commit lock while they drop pages, so no write-back places a page of the range
//! meanwhile.

use super::inode::InodeCell;
use super::meta::{now, Meta, TxSize};
use super::Fs;
use crate::commit::Need;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self as f, BLOCK};

/// Linux's fallocate mode bits.
pub const FALLOC_FL_KEEP_SIZE: u32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: u32 = 0x02;
pub const FALLOC_FL_COLLAPSE_RANGE: u32 = 0x08;
pub const FALLOC_FL_ZERO_RANGE: u32 = 0x10;
pub const FALLOC_FL_INSERT_RANGE: u32 = 0x20;
const SUPPORTED: u32 = FALLOC_FL_KEEP_SIZE
    | FALLOC_FL_PUNCH_HOLE
    | FALLOC_FL_COLLAPSE_RANGE
    | FALLOC_FL_ZERO_RANGE
    | FALLOC_FL_INSERT_RANGE;

/// New extents one preallocation piece may add (its transaction stays small).
const PIECE_EXTENTS: u64 = 64;
/// Blocks one preallocation piece covers at most.
const PIECE_BLOCKS: u64 = 1 << 16;

impl Fs {
    /// The checks fallocate(2) makes before it changes anything (mode, range, kind of
    /// file, immutable and append-only flags): a front end that clears set-ID bits
    /// first (`kill_privs`) calls this before, as the kernel refuses these calls with
    /// the bits kept.
    pub fn fallocate_check(&self, ino: u64, mode: u32, offset: u64, len: u64) -> Result<std::sync::Arc<InodeCell>> {
        self.inner.check_writable()?;
        check_mode(mode, offset, len)?;
        let cell = self.inner.cell(ino)?;
        match cell.kind {
            f::S_IFREG => {}
            f::S_IFDIR => return Err(Error::is_dir("")),
            // As vfs_fallocate.
            f::S_IFIFO => return Err(Error::new(ErrorKind::IllegalSeek, "fallocate of a FIFO")),
            _ => return Err(Error::new(ErrorKind::NoDevice, "fallocate of a special file")),
        }
        {
            // As vfs_fallocate: nothing on an immutable file, only preallocation on an
            // append-only one.
            let node = cell.lock();
            super::attrflags::deny_immutable(&node)?;
            if mode & !FALLOC_FL_KEEP_SIZE != 0 {
                super::attrflags::deny_change(&node)?;
            }
        }
        Ok(cell)
    }

    /// fallocate(2) on inode `ino`: `mode` is 0 or FALLOC_FL_* bits, with the errors
    /// of Linux's vfs_fallocate and ext4 (EINVAL, EOPNOTSUPP, EFBIG, ENODEV, EISDIR,
    /// ENOSPC).
    pub fn fallocate(&self, ino: u64, mode: u32, offset: u64, len: u64) -> Result<()> {
        let cell = self.fallocate_check(ino, mode, offset, len)?;
        let end = offset + len;
        match mode & !FALLOC_FL_KEEP_SIZE {
            0 => {
                let _io = cell.io.write();
                let grow = (mode & FALLOC_FL_KEEP_SIZE == 0).then_some(end);
                self.preallocate(&cell, offset / BLOCK, end.div_ceil(BLOCK), grow)?;
                // Both times, whether the size grows or not, as ext4 and XFS do.
                self.set_size_at_least(&cell, end, mode & FALLOC_FL_KEEP_SIZE == 0, true)?;
            }
            FALLOC_FL_PUNCH_HOLE => {
                // As ext4 (Linux 6.18): no block at or past the end of the file
                // changes; a hole running past it ends with the end's block (blocks
                // preallocated beyond it stay); a punch changes both times, even one
                // past the end (ext4_fallocate's file_modified comes first).
                // The file's lock for the whole change, the size read under it: a
                // truncate or write in between would otherwise see half a punch, or
                // have the file grown back by the edges' zeros.
                let _io = cell.io.write();
                let size = cell.lock().d.size;
                if offset >= size {
                    return self.set_size_at_least(&cell, 0, false, true);
                }
                let end = end.min(size.next_multiple_of(BLOCK));
                self.zero_edges(&cell, offset, end)?;
                self.clear_blocks(&cell, offset.div_ceil(BLOCK), end / BLOCK, false)?;
                self.set_size_at_least(&cell, 0, false, true)?;
            }
            FALLOC_FL_ZERO_RANGE => {
                let _io = cell.io.write();
                self.zero_edges(&cell, offset, end)?;
                self.clear_blocks(&cell, offset.div_ceil(BLOCK), end / BLOCK, true)?;
                let grow = (mode & FALLOC_FL_KEEP_SIZE == 0).then_some(end);
                self.preallocate(&cell, offset / BLOCK, end.div_ceil(BLOCK), grow)?;
                // Zeroing changes the data: both times, whatever the size does.
                self.set_size_at_least(&cell, end, mode & FALLOC_FL_KEEP_SIZE == 0, true)?;
            }
            FALLOC_FL_COLLAPSE_RANGE => {
                let _io = cell.io.write();
                self.shift(&cell, offset, len, false)?;
            }
            FALLOC_FL_INSERT_RANGE => {
                let _io = cell.io.write();
                self.shift(&cell, offset, len, true)?;
            }
            _ => unreachable!("check_mode let only supported modes through"),
        }
        self.inner.maybe_commit();
        Ok(())
    }

    /// lseek(2) with SEEK_HOLE (`hole`) or SEEK_DATA from `offset`: the next offset
    /// in a hole (the end of the file counts as one) or in data. ENXIO at or past the
    /// end of the file, or when no data follows. Unwritten blocks are holes unless a
    /// page of them waits for write-back; pages waiting for their first block are data.
    pub fn seek_hole_data(&self, ino: u64, offset: u64, hole: bool) -> Result<u64> {
        let cell = self.inner.cell(ino)?;
        let _io = cell.io.read();
        let node = cell.lock();
        if node.freed {
            return Err(Error::not_found(""));
        }
        let size = node.d.size;
        if offset >= size {
            return Err(Error::new(ErrorKind::NoSuchAddress, "offset at or past the end of the file"));
        }
        let pages = size.div_ceil(BLOCK);
        let is_data = |i: u64| node.map_data(i).is_some() || node.reserved.contains(&i) || node.converting.contains(&i);
        let first = offset / BLOCK;
        if hole {
            let mut i = first;
            while i < pages && is_data(i) {
                i = match node.extents.range(..=i as u32).next_back() {
                    // Skip a written run at once.
                    Some((s, r)) if !r.unwritten && (*s as u64 + r.len as u64) > i => *s as u64 + r.len as u64,
                    _ => i + 1,
                };
            }
            return Ok(if i >= pages { size } else { (i * BLOCK).max(offset) });
        }
        // The first data block at or after `first`: a written run, a reserved page or a
        // converting one, whichever comes first.
        let run = node
            .extents
            .range(..=u32::try_from(first).unwrap_or(u32::MAX))
            .next_back()
            .into_iter()
            .chain(node.extents.range(u32::try_from(first + 1).unwrap_or(u32::MAX)..))
            .filter(|(s, r)| !r.unwritten && (**s as u64 + r.len as u64) > first)
            .map(|(s, _)| (*s as u64).max(first))
            .next();
        let found = [run, node.reserved.range(first..).next().copied(), node.converting.range(first..).next().copied()]
            .into_iter()
            .flatten()
            .min();
        match found {
            Some(i) if i < pages => Ok((i * BLOCK).max(offset)),
            _ => Err(Error::new(ErrorKind::NoSuchAddress, "no data past the offset")),
        }
    }

    /// Allocate unwritten blocks for the holes among file blocks `from..to`, a piece
    /// (one transaction) at a time. Pages waiting for their first block keep their
    /// reservation (their space is promised already).
    /// `grow_to`: the size the call sets (not KEEP_SIZE): each piece grows the file to
    /// its end, so that a later piece's ENOSPC leaves what was allocated inside the
    /// size, as ext4 does (not as blocks past the end nothing shows).
    fn preallocate(&self, cell: &InodeCell, from: u64, to: u64, grow_to: Option<u64>) -> Result<()> {
        let ino = cell.ino;
        let mut at = from;
        let mut pieces = 0u64;
        while at < to {
            if pieces > 0 {
                if let Some(end) = grow_to {
                    self.set_size_at_least(cell, end.min(at * BLOCK), true, false)?;
                }
            }
            pieces += 1;
            let piece_end = to.min(at.saturating_add(PIECE_BLOCKS));
            let holes = |m: &mut Meta| -> Result<u64> {
                let node = m.inode(ino)?;
                Ok((at..piece_end).filter(|i| node.map(*i).is_none() && !node.reserved.contains(i)).count() as u64)
            };
            let (mut m, n) = self.inner.admitted(|m| {
                let n = holes(m)?;
                let bitmap = m.sb.block_bitmap_blocks;
                let bitmaps = (n / f::BITS_PER_BITMAP_BLOCK + 2 * PIECE_EXTENTS).min(bitmap);
                let tx = m.inode_cost(ino, PIECE_EXTENTS)?.plus(TxSize::new(bitmaps, 0));
                Ok((Need::new(tx, n, false), n))
            })?;
            if n == 0 {
                at = piece_end;
                continue;
            }
            at = self.inner.mutate(&mut m, |m| {
                let tx = m.tx.clone();
                let mut node = m.inode(ino)?;
                if node.freed {
                    return Err(Error::not_found(""));
                }
                let before = node.extents.len() as u64;
                let mut i = at;
                while i < piece_end && (node.extents.len() as u64) < before + PIECE_EXTENTS - 2 {
                    if node.map(i).is_some() || node.reserved.contains(&i) {
                        i += 1;
                        continue;
                    }
                    let mut want = 1;
                    while i + want < piece_end && node.map(i + want).is_none() && !node.reserved.contains(&(i + want)) {
                        want += 1;
                    }
                    let goal = i.checked_sub(1).and_then(|p| node.map(p)).map(|b| b + 1);
                    let (first, got) = m.alloc_data(want, goal)?;
                    node.add_run(i, first, got, true);
                    i += got;
                }
                node.data_meta_dirty = true;
                node.register(&tx, None);
                Ok(i)
            })?;
            drop(m);
            self.inner.maybe_commit();
        }
        Ok(())
    }

    /// Zero the bytes of `offset..end` that lie in partial blocks at its edges, up to
    /// the end of the file (past it they are zeros already), where the block holds data.
    /// The caller holds the file's lock (`io`, for writing).
    fn zero_edges(&self, cell: &InodeCell, offset: u64, end: u64) -> Result<()> {
        let size = cell.size();
        let mut edges = Vec::new();
        if !offset.is_multiple_of(BLOCK) {
            edges.push((offset, end.min(offset.next_multiple_of(BLOCK))));
        }
        // The tail's block, unless the head's edge covered it already (a range inside
        // one block that starts on its boundary has no head edge: it is all tail).
        if !end.is_multiple_of(BLOCK) && (end / BLOCK > offset / BLOCK || offset.is_multiple_of(BLOCK)) {
            edges.push(((end / BLOCK) * BLOCK, end));
        }
        for (a, b) in edges {
            let b = b.min(size);
            if a >= b {
                continue;
            }
            let i = a / BLOCK;
            let held = {
                let node = cell.lock();
                node.map_data(i).is_some() || node.reserved.contains(&i) || node.converting.contains(&i)
            };
            // A block not held (no data, no reservation, not being converted) reads
            // as zeros, its cached page too (a hole's page is zero-filled, and every
            // write reserves or converts): nothing to write, nothing to allocate (a
            // punch that allocated could fail with ENOSPC, and grew st_blocks).
            if held {
                let (_, n) = self.write_locked(cell, a, &vec![0u8; (b - a) as usize], false)?;
                if n as u64 != b - a {
                    return Err(Error::io("zeroing the edge of a range failed part way"));
                }
            }
        }
        Ok(())
    }

    /// Make file blocks `from..to` read as zeros: their pages are dropped (written or
    /// not), and their blocks freed (`unwritten` false: punch) or marked unwritten
    /// (zero range). The caller holds the file's access lock.
    fn clear_blocks(&self, cell: &InodeCell, from: u64, to: u64, unwritten: bool) -> Result<()> {
        if from >= to {
            return Ok(());
        }
        let ino = cell.ino;
        let (m, ()) = self.inner.admitted(|m| {
            let node = m.inode(ino)?;
            let unmap = m.unmap_cost(&node, from);
            drop(node);
            let tx = m.inode_cost(ino, 2)?.plus(TxSize::new(unmap, 0));
            // A punch frees blocks (deleting is how space comes back); a zero range
            // frees none.
            Ok((Need { splits: unwritten, ..Need::tx(tx) }, ()))
        })?;
        // No write-back may place a page of the range between the drop and the change.
        let credit = m.keep_credit();
        let _c = self.inner.commit_lock.lock();
        let dropped = self.inner.cache.drop_range(ino, from, to.min(cell.pages_end().max(from)));
        self.inner.forget_pages(dropped);
        // Blocks the journal carries (hitchhiking) whose pages went: revoked with the
        // change of the block map (zeroed or freed, their logged contents are dead),
        // and written home only as retired blocks until then (`hold_pages`).
        let carried = self.inner.hitch.hold_pages(ino, from, to);
        let mut m = self.inner.meta.lock();
        self.inner.mutate(&mut m, |m| {
            for b in &carried {
                m.revoke(*b);
            }
            let mut node = m.inode(ino)?;
            let freed = if unwritten {
                node.set_written(from, to, true);
                Vec::new()
            } else {
                node.unmap_range(from, to)
            };
            let released = node.forget_pages(from, to);
            m.finish_data_change(node, -(released as i64), freed)
        })?;
        drop(m);
        drop(credit);
        Ok(())
    }

    /// Collapse (`insert` false) or insert `len` bytes at `offset`, both multiples of
    /// the block size: the blocks after move down over the range (freed) or up past a
    /// new hole. The file's dirty pages are written first, so that only its block map
    /// moves; its pages from `offset` on are dropped.
    fn shift(&self, cell: &InodeCell, offset: u64, len: u64, insert: bool) -> Result<()> {
        let ino = cell.ino;
        if !offset.is_multiple_of(BLOCK) || !len.is_multiple_of(BLOCK) {
            return Err(Error::invalid("collapse/insert range: offset and length must be multiples of the block size"));
        }
        let (from, n) = (offset / BLOCK, len / BLOCK);
        let (m, ()) = self.inner.admitted(|m| {
            let node = m.inode(ino)?;
            let size = node.d.size;
            if insert {
                if offset >= size {
                    return Err(Error::invalid("insert range at or past the end of the file"));
                }
                if size.checked_add(len).is_none_or(|s| s > f::MAX_FILE_SIZE) {
                    return Err(Error::file_too_big(""));
                }
                // Blocks preallocated past the end (KEEP_SIZE) move too: none may leave
                // the largest file (ext4's EXT_MAX_BLOCKS check).
                let last = node.extents.iter().next_back().map(|(k, r)| *k as u64 + r.len as u64).unwrap_or(0);
                if last + n > f::MAX_FILE_SIZE / BLOCK {
                    return Err(Error::file_too_big("insert range would move blocks past the largest file"));
                }
            } else if offset.saturating_add(len) >= size {
                return Err(Error::invalid("collapse range reaches the end of the file"));
            }
            let unmap = if insert { 0 } else { m.unmap_cost(&node, from) };
            drop(node);
            let tx = m.inode_cost(ino, 2)?.plus(TxSize::new(unmap, 0));
            // An insert splits the extent at its offset and frees nothing.
            Ok((Need { splits: insert, ..Need::tx(tx) }, ()))
        })?;
        let credit = m.keep_credit();
        let _c = self.inner.commit_lock.lock();
        // Blocks the journal carries are written home first: their pages are dropped
        // and read back from the medium below.
        self.inner.hitchhike_settle_file(ino)?;
        self.inner.writeback_locked()?;
        let dropped = self.inner.cache.drop_range(ino, from, cell.pages_end().max(from));
        self.inner.forget_pages(dropped);
        let mut m = self.inner.meta.lock();
        self.inner.mutate(&mut m, |m| {
            let mut node = m.inode(ino)?;
            let size = node.d.size;
            if (insert && offset >= size) || (!insert && offset + len >= size) {
                // Changed while the lock was dropped (only a concurrent truncate
                // without the access lock could: none exists).
                return Err(Error::invalid("file size changed during collapse/insert"));
            }
            // Pages not written back (their fetch failed) are gone with the drop.
            let released = node.forget_pages(from, u64::MAX);
            let freed = if insert {
                node.shift_from(from, n as i64);
                node.d.size = size + len;
                Vec::new()
            } else {
                let freed = node.unmap_range(from, from + n);
                node.shift_from(from + n, -(n as i64));
                node.d.size = size - len;
                freed
            };
            m.finish_data_change(node, -(released as i64), freed)
        })?;
        drop(m);
        drop(credit);
        Ok(())
    }

    /// After a preallocation, punch or zeroing: the size grows to `end` if `grow`, and
    /// the change time moves; the modification time too when the size changed or the
    /// data did (`modified`: a punch, a zeroing).
    fn set_size_at_least(&self, cell: &InodeCell, end: u64, grow: bool, modified: bool) -> Result<()> {
        let ino = cell.ino;
        let (mut m, ()) = self.inner.admitted(|m| Ok((Need::tx(m.inode_cost(ino, 0)?), ())))?;
        m.update(ino, |node| {
            let t = now();
            if grow && end > node.d.size {
                node.d.size = end;
                node.d.mtime = t;
                node.data_meta_dirty = true;
            }
            if modified {
                node.d.mtime = t;
            }
            node.d.ctime = t;
        })
    }
}

/// The checks of Linux's vfs_fallocate on the mode and range.
fn check_mode(mode: u32, offset: u64, len: u64) -> Result<()> {
    if len == 0 || offset > i64::MAX as u64 || len > i64::MAX as u64 {
        return Err(Error::invalid("fallocate of an empty or negative range"));
    }
    if mode & !SUPPORTED != 0 {
        return Err(Error::unsupported(format!("fallocate mode {mode:#x}")));
    }
    let op = mode & !FALLOC_FL_KEEP_SIZE;
    if op & FALLOC_FL_PUNCH_HOLE != 0 && op & FALLOC_FL_ZERO_RANGE != 0 {
        return Err(Error::unsupported("punch hole and zero range at once"));
    }
    if op == FALLOC_FL_PUNCH_HOLE && mode & FALLOC_FL_KEEP_SIZE == 0 {
        return Err(Error::unsupported("punch hole without KEEP_SIZE"));
    }
    for only in [FALLOC_FL_COLLAPSE_RANGE, FALLOC_FL_INSERT_RANGE] {
        if mode & only != 0 && mode != only {
            // EOPNOTSUPP since Linux 6.15's check of the mode (EINVAL before).
            return Err(Error::unsupported("collapse/insert range with other mode bits"));
        }
    }
    if op.count_ones() > 1 {
        return Err(Error::unsupported(format!("fallocate mode {mode:#x}")));
    }
    if offset.checked_add(len).is_none_or(|e| e > f::MAX_FILE_SIZE) {
        return Err(Error::file_too_big(""));
    }
    Ok(())
}
