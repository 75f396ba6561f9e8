//! hitchhike: mechanism 3 — small synchronous writes ride, as compressed deltas, in the
//! commit block that the fsync writes anyway, instead of costing a block write each.
//!
//! The write-back buffer ([`Hitchhike`]) holds, for each data block whose small
//! synchronous writes the journal carries, its last durable version (what a replay of
//! the log gives it), indexed by block number. Its two LRU lists are kept as a bit per
//! block: active (an fsync'd change since the last aging) or inactive; aging, once per
//! interval of the write-back thread, moves active blocks to inactive and lets go of
//! blocks inactive for a whole interval when the buffer is more than half full or the
//! file system is idle. At a commit for an fsync:
//!
//! - a dirty page of a block in the buffer is XORed with its durable version and the
//!   XOR compressed (LZ4, `journal::make_delta`); the delta rides in the commit block
//!   if it has room, else the journal logs the block whole. Either way the page is
//!   not written in place: while the log holds a block, the log is the only way to
//!   its home (`journal.rs`: a replay never needs the medium's copy of it).
//! - a page of the fsync'd file whose block is newly allocated (or was unwritten: it
//!   read as zeros) enters the buffer with a delta from zeros, if that is small: a
//!   64-byte append into a fresh block costs a record of ~100 bytes, not a block.
//! - every other page is written in place, as without hitchhiking.
//!
//! A block leaves the buffer by being written home whole: at a checkpoint (which
//! writes every logged block home), or when aging lets go of it: then its page is
//! written in place in a commit that revokes its records (the in-place write is
//! flushed before that commit; until it is durable a replay rebuilds the block from
//! the log). A block freed (truncate, delete) leaves with a revoke. While it is in
//! the buffer its page stays in the cache (the buffer holds it), since the medium's
//! copy is stale until the checkpoint.
//!
//! The off-switch is `Config::hitchhike` (`pwfs mount --hitchhike off`).

use crate::cache::Page;
use crate::device::AlignedBuf;
use crate::format::{BLOCK_SIZE, JCOMMIT_EXTRA_MAX, JDELTA_HEADER};
use crate::journal::DataBlock;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes of the commit block kept for deltas of metadata (the inode's table block,
/// a bitmap block): data deltas may use the rest.
const META_ROOM: usize = 512;

/// What write-back does with one page.
pub(crate) enum Route {
    /// Written in place (as without hitchhiking).
    InPlace,
    /// Carried by this commit's journal transaction; the page is clean afterwards.
    Journal,
    /// Left dirty for the next commit (a write-back outside a commit met a block the
    /// log holds).
    Keep,
}

struct Entry {
    /// The block's page, held so that the cache keeps it while the medium's copy of
    /// the block is stale.
    page: Arc<Page>,
    /// The contents a replay of the log gives the block.
    durable: Arc<AlignedBuf>,
    /// Received a synchronous write since the last aging.
    active: bool,
    retiring: Retiring,
    /// Held by a zero range or punch (`hold_pages`) when `Buffer::commits` commits
    /// had completed: the next commit to complete carries its revoke, and then it
    /// leaves (the log's older contents are revoked; nothing writes them home).
    held: Option<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Retiring {
    No,
    /// To be written home whole by the next commit that writes its page.
    Marked,
    /// Written in place by the commit in progress, which revokes its records.
    Written,
}

#[derive(Default)]
struct Buffer {
    entries: HashMap<u64, Entry>,
    /// Records for the commit in progress.
    staged: Vec<DataBlock>,
    staged_bytes: usize,
    /// Blocks written in place by the commit in progress (their records revoked).
    retired: Vec<u64>,
    /// Fresh blocks an fdatasync's write-back left for its commit (`Route::Keep`).
    fresh: std::collections::HashSet<u64>,
    /// Blocks not fresh tried in the commit in progress.
    tries: usize,
    /// Blocks that left the buffer by being freed since the running transaction began
    /// (each a revoke in it): with the blocks in the buffer, at most `max`, so that
    /// the revokes of a transaction stay within `reserve`.
    forgotten: usize,
    /// Commits completed (`committed`).
    commits: u64,
}

impl Buffer {
    /// Bytes the next data delta of the commit in progress may take in its commit
    /// block (what is left of the room for data, less the record's header).
    fn delta_room(&self) -> usize {
        (JCOMMIT_EXTRA_MAX - META_ROOM).saturating_sub(self.staged_bytes + JDELTA_HEADER)
    }
}

/// Blocks that are not fresh tried per commit.
const OTHER_TRIES: usize = 16;

/// A commit writing at most this many pages may log fresh blocks of fsync'd files
/// whole when their deltas do not fit: with no data written in place, its journal
/// needs one flush in all (`Journal::finish`) instead of one before and one after.
pub(crate) const SMALL_COMMIT: usize = 8;

/// Counters (`Fs::hitchhike_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HitchhikeStats {
    /// Hitchhiking serves this mount (on, writable, and a journal with room for it).
    pub active: bool,
    /// The most blocks the buffer holds.
    pub capacity: u64,
    /// Pages of fsync'd files written by commits for an fsync (the small synchronous
    /// writes seen).
    pub sync_pages: u64,
    /// Of those, carried as deltas in the commit block.
    pub hitchhiked: u64,
    /// Metadata blocks carried as deltas instead of images.
    pub meta_deltas: u64,
    /// Data blocks the log took whole (the delta did not fit).
    pub data_images: u64,
    /// Block bytes not written thanks to deltas (4 KiB per delta, less its record).
    pub bytes_saved: u64,
    /// Commits that wrote nothing but their commit block.
    pub commit_only: u64,
    /// Commits for an fsync.
    pub sync_commits: u64,
    /// Blocks written home whole after idling in the buffer.
    pub retired: u64,
    /// Blocks in the buffer now.
    pub buffered: u64,
}

pub(crate) struct Hitchhike {
    on: bool,
    /// The most blocks the buffer holds (also the most data records in a transaction,
    /// for which `FsInner::tx_room` keeps log room back).
    max: usize,
    buf: Mutex<Buffer>,
    len: AtomicUsize,
    /// `Buffer::fresh`'s length (so that `forget` needs no lock when both are empty).
    fresh_len: AtomicUsize,
    /// Pages a write-back outside a commit left dirty (`Route::Keep`).
    pub(crate) kept: AtomicU64,
    sync_pages: AtomicU64,
    hitchhiked: AtomicU64,
    sync_commits: AtomicU64,
    /// `sync_commits` at the last aging: none since means the file system is idle.
    aged_at: AtomicU64,
    retired: AtomicU64,
}

impl Hitchhike {
    /// `tx_cap`: the journal's log blocks; `spare`: the log blocks operations are
    /// admitted into (`commit::admission_room`) beyond what the largest single
    /// operation may need (mkfs sizes the journal for it): the room kept back for
    /// hitchhiking never cuts into that. A journal too small for both has none.
    pub(crate) fn new(on: bool, blocks: usize, tx_cap: u64, spare: u64) -> Hitchhike {
        let spare = spare / 4;
        let max = if on { blocks.min((tx_cap / 16) as usize).min(spare as usize) } else { 0 };
        Hitchhike {
            on: on && max > 0,
            max,
            buf: Mutex::new(Buffer::default()),
            len: AtomicUsize::new(0),
            fresh_len: AtomicUsize::new(0),
            kept: AtomicU64::new(0),
            sync_pages: AtomicU64::new(0),
            hitchhiked: AtomicU64::new(0),
            sync_commits: AtomicU64::new(0),
            aged_at: AtomicU64::new(0),
            retired: AtomicU64::new(0),
        }
    }

    /// Log blocks a transaction may need beyond what operations were admitted for:
    /// a record and up to two revokes per buffered block, and their descriptors.
    pub(crate) fn reserve(&self) -> u64 {
        if !self.on {
            return 0;
        }
        let n = 3 * self.max as u64;
        n + n.div_ceil(crate::format::JDESC_ENTRIES as u64)
    }

    /// Decide what write-back does with `page` (to be written to `block`, contents
    /// `data`). `commit`: write-back of a commit; `sync`: the page belongs to a file
    /// an fsync waits for; `small`: a commit of few pages (`SMALL_COMMIT`), which may
    /// log a fresh block whole when its delta does not fit; `fresh`: the block was just
    /// allocated or was unwritten (its contents before were zeros). Called under the
    /// metadata lock, so that a block freed meanwhile (`forget`, under the same lock)
    /// is never staged.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn route(
        &self,
        block: u64,
        page: &Arc<Page>,
        data: &[u8],
        commit: bool,
        sync: bool,
        small: bool,
        fresh: bool,
    ) -> Route {
        if !self.on {
            return Route::InPlace;
        }
        if commit && sync {
            self.sync_pages.fetch_add(1, Ordering::Relaxed);
        }
        let mut g = self.buf.lock();
        let b = &mut *g;
        let room = b.delta_room();
        if let Some(e) = b.entries.get_mut(&block) {
            if !commit {
                self.kept.fetch_add(1, Ordering::Relaxed);
                return Route::Keep;
            }
            if e.retiring != Retiring::No {
                e.retiring = Retiring::Written;
                b.retired.push(block);
                return Route::InPlace;
            }
            e.active |= sync;
            let delta = crate::journal::make_delta(block, data, Some(&e.durable), room);
            if let Some(d) = &delta {
                b.staged_bytes += d.encoded_len();
                if sync {
                    self.hitchhiked.fetch_add(1, Ordering::Relaxed);
                }
            }
            b.staged.push(DataBlock { block, content: Arc::new(AlignedBuf::from_slice(data)), delta });
            return Route::Journal;
        }
        if !sync || b.entries.len() + b.forgotten >= self.max {
            return Route::InPlace;
        }
        if !commit {
            // An fdatasync's write-back: a fresh block (its file's block map changes,
            // so the fdatasync commits anyway) waits for that commit, which may carry it.
            if !fresh {
                return Route::InPlace;
            }
            b.fresh.insert(block);
            self.fresh_len.store(b.fresh.len(), Ordering::Release);
            self.kept.fetch_add(1, Ordering::Relaxed);
            return Route::Keep;
        }
        // Fresh blocks are tried (their old contents are zeros: a small write into one
        // compresses well), and a few others per commit (a delta from zeros is the
        // whole block, compressed: right for any block, small for a sparse one).
        let fresh = fresh || b.fresh.remove(&block);
        self.fresh_len.store(b.fresh.len(), Ordering::Release);
        let whole = small && fresh;
        if !fresh {
            if b.tries >= OTHER_TRIES {
                return Route::InPlace;
            }
            b.tries += 1;
        }
        let delta = crate::journal::make_delta(block, data, None, room);
        match &delta {
            Some(d) => {
                b.staged_bytes += d.encoded_len();
                self.hitchhiked.fetch_add(1, Ordering::Relaxed);
            }
            None if whole => {}
            None => return Route::InPlace,
        }
        let content = Arc::new(AlignedBuf::from_slice(data));
        b.staged.push(DataBlock { block, content: content.clone(), delta });
        b.entries.insert(
            block,
            Entry { page: page.clone(), durable: content, active: true, retiring: Retiring::No, held: None },
        );
        self.len.store(b.entries.len(), Ordering::Release);
        Route::Journal
    }

    /// A block is freed: it leaves the buffer, and a record staged for it is dropped.
    /// Returns whether the log may hold it (the caller revokes it).
    pub(crate) fn forget(&self, block: u64) -> bool {
        if self.len.load(Ordering::Acquire) == 0 && self.fresh_len.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut g = self.buf.lock();
        if g.fresh.remove(&block) {
            self.fresh_len.store(g.fresh.len(), Ordering::Release);
        }
        let was = g.entries.remove(&block).is_some();
        if was {
            g.forgotten += 1;
            g.staged.retain(|d| d.block != block);
            g.retired.retain(|b| *b != block);
            self.len.store(g.entries.len(), Ordering::Release);
        }
        was
    }

    /// Pages `from..to` of `ino` were dropped (zero range, punch): the caller revokes
    /// the blocks returned, in the transaction that changes the block map. The blocks
    /// stay in the buffer, marked to be written home whole, until that transaction is
    /// durable: the log still holds their older contents (a checkpoint before then
    /// writes them home), so a block rewritten meanwhile must not be written in place
    /// except by a commit that lists it as retired (which that checkpoint skips).
    /// Called under the commit lock (no write-back routes meanwhile).
    pub(crate) fn hold_pages(&self, ino: u64, from: u64, to: u64) -> Vec<u64> {
        if self.len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut g = self.buf.lock();
        let commits = g.commits;
        let mut held = Vec::new();
        for (b, e) in g.entries.iter_mut() {
            if e.page.key.0 == ino && (from..to).contains(&e.page.key.1) {
                if e.retiring != Retiring::Written {
                    e.retiring = Retiring::Marked;
                    e.held = Some(commits);
                }
                held.push(*b);
            }
        }
        g.forgotten += held.len();
        held
    }

    /// The records and revokes of the commit in progress, for its transaction.
    pub(crate) fn take_staged(&self, sync: bool) -> (Vec<DataBlock>, Vec<u64>) {
        if sync {
            self.sync_commits.fetch_add(1, Ordering::Relaxed);
        }
        if !self.on {
            return (Vec::new(), Vec::new());
        }
        let mut g = self.buf.lock();
        g.staged_bytes = 0;
        g.tries = 0;
        g.forgotten = 0;
        g.fresh.clear();
        self.fresh_len.store(0, Ordering::Release);
        (std::mem::take(&mut g.staged), std::mem::take(&mut g.retired))
    }

    /// The transaction that carried `logged` (data blocks) is durable: their durable
    /// versions are its contents; blocks it wrote home whole leave the buffer; after a
    /// checkpoint, every block it did not carry is home and leaves too.
    pub(crate) fn committed(&self, logged: &[(u64, Arc<AlignedBuf>)], checkpointed: bool) {
        if !self.on {
            return;
        }
        let mut g = self.buf.lock();
        let before = g.entries.len();
        // Held blocks whose revoke this commit carried (held before it began, under
        // the commit lock) leave with the blocks it wrote home.
        let done = g.commits;
        g.commits += 1;
        g.entries.retain(|_, e| {
            e.retiring != Retiring::Written && !(e.retiring == Retiring::Marked && e.held.is_some_and(|h| h <= done))
        });
        self.retired.fetch_add((before - g.entries.len()) as u64, Ordering::Relaxed);
        if checkpointed {
            let keep: std::collections::HashSet<u64> = logged.iter().map(|(b, _)| *b).collect();
            g.entries.retain(|b, _| keep.contains(b));
        }
        for (b, content) in logged {
            if let Some(e) = g.entries.get_mut(b) {
                e.durable = content.clone();
            }
        }
        self.len.store(g.entries.len(), Ordering::Release);
    }

    /// Mark the blocks of `ino` in the buffer to be written home whole by the next
    /// commit (before an operation that moves the file's blocks and reads them back
    /// from the medium: collapse and insert range). Returns their pages, for the
    /// caller to mark dirty.
    pub(crate) fn mark_file(&self, ino: u64) -> Vec<Arc<Page>> {
        if self.len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut g = self.buf.lock();
        let mut out = Vec::new();
        for e in g.entries.values_mut() {
            if e.page.key.0 == ino {
                e.retiring = Retiring::Marked;
                out.push(e.page.clone());
            }
        }
        out
    }

    /// Every logged block is home (a checkpoint outside a commit): the buffer empties.
    pub(crate) fn checkpointed(&self) {
        let mut g = self.buf.lock();
        g.entries.clear();
        self.len.store(0, Ordering::Release);
    }

    /// Aging, before a periodic commit of the write-back thread: active blocks become
    /// inactive; blocks inactive since the last aging are written home whole by the
    /// next commits if the buffer is more than half full or no fsync committed since
    /// the last aging (idle). Returns their pages, for the caller to mark dirty.
    pub(crate) fn age(&self) -> Vec<Arc<Page>> {
        if self.len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let syncs = self.sync_commits.load(Ordering::Relaxed);
        let idle = self.aged_at.swap(syncs, Ordering::Relaxed) == syncs;
        let mut g = self.buf.lock();
        let full = g.entries.len() * 2 > self.max;
        let mut out = Vec::new();
        for e in g.entries.values_mut() {
            if e.retiring == Retiring::Written {
                // Being written home by a commit in progress.
                continue;
            }
            if e.active {
                e.active = false;
            } else if full || idle || e.retiring != Retiring::No {
                e.retiring = Retiring::Marked;
                out.push(e.page.clone());
            }
        }
        out
    }

    /// Counters; the journal's own (deltas by kind, commit-only commits) are added by
    /// the caller.
    pub(crate) fn stats(&self, j: &crate::journal::JournalStats) -> HitchhikeStats {
        let t = j.deltas;
        HitchhikeStats {
            active: self.on,
            capacity: self.max as u64,
            sync_pages: self.sync_pages.load(Ordering::Relaxed),
            hitchhiked: self.hitchhiked.load(Ordering::Relaxed),
            meta_deltas: t.meta,
            data_images: t.data_images,
            bytes_saved: ((t.meta + t.data) * BLOCK_SIZE as u64).saturating_sub(t.bytes),
            commit_only: j.commit_only,
            sync_commits: self.sync_commits.load(Ordering::Relaxed),
            retired: self.retired.load(Ordering::Relaxed),
            buffered: self.len.load(Ordering::Relaxed) as u64,
        }
    }
}
