//! fs: the file system — namespace, inodes, directories, and file I/O entry points.
//!
//! Layers (DESIGN.md §2), top to bottom:
//! - `api`: the path-based Rust API (`Fs::open`, `File`, `OpenOptions`, ...).
//! - this module: inode-level operations, used by `api` and by front ends (FUSE).
//! - `meta`: metadata state under one mutex; `lock` orders file access; `cache`
//!   holds file data; `journal` makes metadata durable; `alloc` and `format` below.
//!
//! Commit protocol (ordered mode; docs/FORMAT.md walks the crash cases): under the
//! commit lock, write back dirty data (allocating its blocks: delayed allocation),
//! wait for it, close the metadata transaction, log it, flush, write the commit
//! block, flush. Blocks freed by the transaction become reusable only after that.
//! Any failed device write or flush poisons the file system: it turns read-only and
//! every later change fails with EROFS, so a lost write is never reported as success.

pub mod api;
pub mod meta;
mod ops;

use crate::cache::{Page, PageCache};
use crate::config::{Config, FetchPolicy};
use crate::device::{AlignedBuf, Device, Op, OpKind};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self as f, Superblock, BLOCK, BLOCK_SIZE};
use crate::journal::{self, Journal};
use crate::lock::LockTable;
use meta::Meta;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

pub use api::{DirEntry, File, FileType, Metadata, OpenOptions, SetAttr, StatFs};

/// Options for formatting a device.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Number of inodes (default: one per 16 KiB, at least 1024).
    pub inodes: Option<u64>,
    /// Journal size in blocks (default: 1/64 of the device, 256..=16384 blocks).
    pub journal_blocks: Option<u64>,
}

/// A mounted file system. Cheap to clone; the last handle (open `File`s included)
/// to go away flushes and empties the journal, as `unmount` does explicitly.
#[derive(Clone)]
pub struct Fs {
    pub(crate) inner: Arc<FsInner>,
}

pub(crate) struct FsInner {
    pub dev: Arc<dyn Device>,
    pub sb: Superblock,
    pub config: Config,
    pub meta: Mutex<Meta>,
    pub journal: Mutex<Journal>,
    /// The most log blocks one transaction may take (the journal's log): operations
    /// are admitted only while the running transaction, with what they add, fits.
    pub tx_cap: u64,
    pub cache: PageCache,
    pub locks: LockTable,
    /// Serializes write-back, commit, and block freeing (see `lock` for the order).
    pub commit_lock: Mutex<()>,
    poisoned: Mutex<Option<String>>,
    /// Stop flag and wake-up of the write-back thread (shared, so that it waits
    /// without keeping the file system alive).
    wake: Arc<(Mutex<bool>, Condvar)>,
    /// The write-back thread was woken for dirty data (not by its timer).
    kick: std::sync::atomic::AtomicBool,
    /// Writers over the dirty limit wait here for the write-back thread.
    throttle: (Mutex<()>, Condvar),
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Readahead and fetcher threads: joined at shutdown, so that none of them still
    /// holds the file system (and its device, and the image lock) after an unmount.
    helpers: Mutex<Vec<JoinHandle<()>>>,
    /// Readahead: per file, where its sequential reader is expected next and the
    /// first page not yet queued for reading ahead; and the background reader's queue.
    ra_next: Mutex<std::collections::HashMap<u64, (u64, u64)>>,
    ra_queue: Mutex<Option<std::sync::mpsc::Sender<(u64, u64, u64)>>>,
    /// Readahead requests queued or being read.
    ra_pending: AtomicU64,
    /// Pages with patches for the fetcher thread (AsyncForeground/AsyncBackground).
    fetch_queue: Mutex<Option<std::sync::mpsc::Sender<(u64, u64)>>>,
    /// Files whose patches were lost to a failed fetch after their writes returned:
    /// the next fsync of the file reports EIO (then the error is consumed).
    pub fetch_errors: Mutex<std::collections::HashSet<u64>>,
    pub stats: FsStats,
}

#[derive(Debug, Default)]
pub struct FsStats {
    pub data_writes: AtomicU64,
    pub data_reads: AtomicU64,
    pub fetches_for_partial_write: AtomicU64,
    /// Non-blocking writes (mechanism 1).
    pub patches_created: AtomicU64,
    pub patches_merged: AtomicU64,
    /// Pages that got data by being overwritten whole after patches: no fetch at all.
    pub fetches_avoided: AtomicU64,
    /// Fetches left to later (Lazy) or to the fetcher thread.
    pub fetches_deferred: AtomicU64,
    pub reads_from_patches: AtomicU64,
    pub patch_memory_fallbacks: AtomicU64,
    /// Bytes held in patches right now.
    pub patch_bytes: std::sync::atomic::AtomicI64,
    /// Pages holding patches and no data right now (they are dirty but hold no page
    /// buffer, so they do not count against the dirty-page limit; patch memory bounds
    /// them instead).
    pub patched_pages: std::sync::atomic::AtomicI64,
}

/// A copy of the non-blocking-write counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NbwStats {
    pub patches_created: u64,
    pub patches_merged: u64,
    pub fetches_avoided: u64,
    pub fetches_deferred: u64,
    pub reads_from_patches: u64,
    pub patch_memory_fallbacks: u64,
    pub partial_write_fetches: u64,
    pub patch_bytes: i64,
    pub patched_pages: i64,
}

/// What the journal held at mount.
#[derive(Debug, Clone, Default)]
pub struct MountReport {
    pub transactions_replayed: usize,
    pub blocks_replayed: usize,
    pub orphans_freed: usize,
    pub used_backup_superblock: bool,
}

fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Format `dev`. Everything on it is lost.
pub fn mkfs(dev: &dyn Device, opts: &MkfsOptions) -> Result<Superblock> {
    let total = dev.len() / BLOCK;
    if total < 64 {
        return Err(Error::invalid(format!("device too small: {} bytes (need at least 256 KiB)", dev.len())));
    }
    let inodes = opts.inodes.unwrap_or((total / 4).max(1024)).min(u32::MAX as u64);
    // The log must hold the largest single operation: a truncate or delete that
    // changes every block-bitmap block, plus a few inode and directory blocks.
    let min_journal = total.div_ceil(f::BITS_PER_BITMAP_BLOCK) + 32;
    let jblocks = match opts.journal_blocks {
        Some(n) if n < min_journal => {
            return Err(Error::invalid(format!(
                "a journal of {n} blocks is too small for {total} blocks: it needs at least {min_journal}"
            )))
        }
        Some(n) => n.min(total / 4).max(16),
        None => (total / 64).clamp(256, 16384).max(min_journal).min(total / 4).max(16),
    };
    let mut uuid = [0u8; 16];
    rand::Rng::fill(&mut rand::thread_rng(), &mut uuid[..]);
    let sb = Superblock::layout(total, inodes, jblocks, uuid, now_ns())
        .map_err(|e| Error::invalid(format!("cannot lay out a file system on {total} blocks: {e}")))?;
    let write = |block: u64, bufs: Vec<AlignedBuf>| -> Result<()> {
        for d in dev.submit(vec![Op { kind: OpKind::Write, offset: block * BLOCK, bufs }]) {
            d.result?;
        }
        Ok(())
    };
    let zeros = |n: u64| (0..n).map(|_| dev.alloc_zeroed(BLOCK_SIZE)).collect::<Vec<_>>();
    // Inode table and the first log block: zeroed, so nothing of an earlier format is read.
    let mut b = sb.inode_table_start;
    while b < sb.data_start {
        let n = (sb.data_start - b).min(256);
        write(b, zeros(n))?;
        b += n;
    }
    write(sb.journal_start + 1, zeros(1))?;
    // Block bitmap: everything outside the data area is in use.
    for i in 0..sb.block_bitmap_blocks {
        let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
        for bit in 0..f::BITS_PER_BITMAP_BLOCK {
            let blk = i * f::BITS_PER_BITMAP_BLOCK + bit;
            if blk < sb.data_start || (blk >= sb.data_end && blk < total) {
                buf[(bit / 8) as usize] |= 1 << (bit % 8);
            }
        }
        f::bitmap_seal(&mut buf, i);
        write(sb.block_bitmap_start + i, vec![buf])?;
    }
    for i in 0..sb.inode_bitmap_blocks {
        let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
        if i == 0 {
            buf[0] = 1; // the root inode
        }
        f::bitmap_seal(&mut buf, i);
        write(sb.inode_bitmap_start + i, vec![buf])?;
    }
    let t = meta::now();
    let root = f::DiskInode {
        mode: f::S_IFDIR | 0o755,
        nlink: 2,
        parent: f::ROOT_INO,
        atime: t,
        mtime: t,
        ctime: t,
        generation: 1,
        ..Default::default()
    };
    let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
    root.encode(f::ROOT_INO, &mut buf[..f::INODE_SIZE]);
    write(sb.inode_table_start, vec![buf])?;
    // A start sequence nobody used before on this medium, so stale log blocks never match.
    let start_seq = (rand::random::<u32>() as u64) << 20 | 1;
    journal::write_header(dev, sb.journal_start, start_seq)?;
    let mut buf = dev.alloc(BLOCK_SIZE);
    sb.encode(&mut buf);
    let backup = AlignedBuf::from_slice(&buf);
    write(total - 1, vec![backup])?;
    dev.flush()?;
    // The primary superblock last: until it is written the device is not a pwfs image.
    write(0, vec![buf])?;
    dev.flush()?;
    Ok(sb)
}

/// Read and check the superblock, falling back to the backup copy.
pub fn read_superblock(dev: &dyn Device) -> Result<(Superblock, bool)> {
    let total = dev.len() / BLOCK;
    if total < 64 {
        return Err(Error::corrupt(format!("device too small to hold a pwfs image ({} bytes)", dev.len())));
    }
    let read = |b: u64| -> Result<AlignedBuf> {
        let (buf, r) = dev.read(b * BLOCK, dev.alloc(BLOCK_SIZE));
        r?;
        Ok(buf)
    };
    let (sb, backup) = match Superblock::decode(&read(0)?) {
        Ok(sb) => (sb, false),
        Err(primary) => match Superblock::decode(&read(total - 1)?) {
            Ok(sb) if !matches!(primary, f::FormatError::Magic { .. }) => (sb, true),
            _ => {
                return Err(Error::corrupt(match primary {
                    f::FormatError::Magic { .. } => "not a pwfs image (no superblock magic)".to_string(),
                    e => format!("bad superblock and no usable backup: {e}"),
                }))
            }
        },
    };
    if sb.total_blocks > total {
        return Err(Error::corrupt(format!(
            "image truncated: superblock says {} blocks, device has {total}",
            sb.total_blocks
        )));
    }
    Ok((sb, backup))
}

impl Fs {
    /// Mount a formatted device: check the superblock, replay the journal, free orphans.
    pub fn mount(dev: Arc<dyn Device>, config: Config) -> Result<Fs> {
        Fs::mount_report(dev, config).map(|(fs, _)| fs)
    }

    pub fn mount_report(dev: Arc<dyn Device>, config: Config) -> Result<(Fs, MountReport)> {
        config.validate()?;
        let (sb, used_backup) = read_superblock(&*dev)?;
        if config.check_on_mount {
            // Before anything is written: a damaged image is refused unchanged.
            let r = crate::fsck::check(&*dev)?;
            if !r.is_clean() {
                let n = r.errors.len();
                let first = r.errors.iter().take(3).cloned().collect::<Vec<_>>().join("; ");
                return Err(Error::corrupt(format!(
                    "image fails its consistency check ({n} problem(s): {first}); run `pwfs fsck` for the full report"
                )));
            }
        }
        let scan = journal::scan(&*dev, &sb)?;
        let mut report = MountReport {
            used_backup_superblock: used_backup,
            transactions_replayed: scan.transactions.len(),
            ..Default::default()
        };
        let preloaded = if config.read_only {
            journal::plan(&scan)
        } else {
            report.blocks_replayed = journal::replay(&*dev, &sb, &scan)?;
            Default::default()
        };
        let meta = Meta::load(sb.clone(), dev.clone(), preloaded)?;
        let journal = Journal::new(&sb, scan.next_seq());
        let inner = Arc::new(FsInner {
            tx_cap: journal.capacity(),
            journal: Mutex::new(journal),
            cache: PageCache::new((config.cache_bytes / BLOCK) as usize),
            dev,
            sb,
            meta: Mutex::new(meta),
            locks: LockTable::default(),
            commit_lock: Mutex::new(()),
            poisoned: Mutex::new(None),
            wake: Arc::new((Mutex::new(false), Condvar::new())),
            kick: Default::default(),
            throttle: (Mutex::new(()), Condvar::new()),
            thread: Mutex::new(None),
            helpers: Mutex::new(Vec::new()),
            ra_next: Mutex::new(Default::default()),
            ra_queue: Mutex::new(None),
            ra_pending: AtomicU64::new(0),
            fetch_queue: Mutex::new(None),
            fetch_errors: Mutex::new(Default::default()),
            stats: FsStats::default(),
            config,
        });
        // The root must be a directory.
        if !inner.meta.lock().inode(f::ROOT_INO)?.is_dir() {
            return Err(Error::corrupt("root inode is not a directory"));
        }
        if !inner.config.read_only {
            report.orphans_freed = inner.free_orphans()?;
            inner.commit()?;
        }
        if let Some(every) = inner.config.writeback_interval.filter(|_| !inner.config.read_only) {
            let (weak, wake) = (Arc::downgrade(&inner), inner.wake.clone());
            let h = std::thread::Builder::new()
                .name("pwfs-writeback".into())
                .spawn(move || writeback_thread(weak, wake, every))
                .map_err(|e| Error::io(format!("cannot start the write-back thread: {e}")))?;
            *inner.thread.lock() = Some(h);
        }
        if matches!(inner.config.fetch, FetchPolicy::AsyncForeground | FetchPolicy::AsyncBackground) {
            let (tx, rx) = std::sync::mpsc::channel();
            let weak = Arc::downgrade(&inner);
            let h = std::thread::Builder::new()
                .name("pwfs-fetcher".into())
                .spawn(move || fetcher_thread(weak, rx))
                .map_err(|e| Error::io(format!("cannot start the fetcher thread: {e}")))?;
            inner.helpers.lock().push(h);
            *inner.fetch_queue.lock() = Some(tx);
        }
        if inner.config.readahead_pages > 0 {
            // Two readers, so that one request's bookkeeping overlaps the other's I/O.
            let (tx, rx) = std::sync::mpsc::channel();
            let rx = Arc::new(Mutex::new(rx));
            for _ in 0..2 {
                let (weak, rx) = (Arc::downgrade(&inner), rx.clone());
                let h = std::thread::Builder::new()
                    .name("pwfs-readahead".into())
                    .spawn(move || readahead_thread(weak, rx))
                    .map_err(|e| Error::io(format!("cannot start the readahead thread: {e}")))?;
                inner.helpers.lock().push(h);
            }
            *inner.ra_queue.lock() = Some(tx);
        }
        Ok((Fs { inner }, report))
    }

    /// Flush everything, empty the journal and stop the background thread.
    pub fn unmount(self) -> Result<()> {
        self.inner.shutdown()
    }

    pub fn superblock(&self) -> &Superblock {
        &self.inner.sb
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.dev
    }

    /// Why the file system turned read-only, if it did.
    pub fn poisoned(&self) -> Option<String> {
        self.inner.poisoned.lock().clone()
    }

    /// Commit everything (sync(2)).
    pub fn sync(&self) -> Result<()> {
        self.inner.commit()
    }

    /// Drop every clean cached page (benchmarks use it for cold runs). Readahead
    /// still in flight is waited for first, so that it neither lands in the cache
    /// afterwards nor keeps the device busy for whoever runs next.
    pub fn evict_cache(&self) -> Result<()> {
        while self.inner.ra_pending.load(Ordering::Acquire) > 0 {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        self.inner.commit()?;
        self.inner.cache.evict_clean();
        Ok(())
    }

    pub fn cache_stats(&self) -> (u64, u64, u64) {
        let s = &self.inner.cache.stats;
        (s.hits.load(Ordering::Relaxed), s.misses.load(Ordering::Relaxed), s.evictions.load(Ordering::Relaxed))
    }

    /// Counters of the non-blocking writes (mechanism 1).
    pub fn nbw_stats(&self) -> NbwStats {
        let s = &self.inner.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NbwStats {
            patches_created: l(&s.patches_created),
            patches_merged: l(&s.patches_merged),
            fetches_avoided: l(&s.fetches_avoided),
            fetches_deferred: l(&s.fetches_deferred),
            reads_from_patches: l(&s.reads_from_patches),
            patch_memory_fallbacks: l(&s.patch_memory_fallbacks),
            partial_write_fetches: l(&s.fetches_for_partial_write),
            patch_bytes: s.patch_bytes.load(Ordering::Relaxed),
            patched_pages: s.patched_pages.load(Ordering::Relaxed),
        }
    }

    pub fn journal_stats(&self) -> journal::JournalStats {
        self.inner.journal.lock().stats
    }
}

impl std::fmt::Debug for Fs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fs({} blocks on {})", self.inner.sb.total_blocks, self.inner.dev.name())
    }
}

impl Drop for FsInner {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// Fetches the pages a sequential reader will ask for next, while it copies out
/// the ones it has: the device works while the CPU does.
/// Resolves pages with patches (reads their data, applies the patches) in the
/// background, for the asynchronous fetch policies.
fn fetcher_thread(fs: Weak<FsInner>, rx: std::sync::mpsc::Receiver<(u64, u64)>) {
    while let Ok(first) = rx.recv() {
        // Everything queued meanwhile goes to the device in one batch.
        let mut batch: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
        batch.entry(first.0).or_default().push(first.1);
        while let Ok((ino, idx)) = rx.try_recv() {
            batch.entry(ino).or_default().push(idx);
            if batch.values().map(Vec::len).sum::<usize>() >= 256 {
                break;
            }
        }
        let Some(inner) = fs.upgrade() else { return };
        for (ino, idxs) in batch {
            // The pages are claimed under the inode lock (as a reader: a truncate sees
            // them in the cache and waits for them), and read without it, so that
            // writers to other pages of the file do not wait for this I/O.
            let claimed = {
                let _g = inner.locks.read(ino);
                let pages: Vec<Arc<Page>> = idxs.into_iter().filter_map(|i| inner.cache.get((ino, i))).collect();
                inner.claim(pages)
            };
            if let Err(e) = inner.fetch(ino, claimed) {
                // The writes are reported lost by the file's next fsync or close.
                tracing::warn!(ino, "background fetch for non-blocking writes failed: {e}");
            }
        }
    }
}

type RaQueue = Arc<Mutex<std::sync::mpsc::Receiver<(u64, u64, u64)>>>;

fn readahead_thread(fs: Weak<FsInner>, rx: RaQueue) {
    loop {
        let Ok((ino, first, n)) = rx.lock().recv() else { return };
        let Some(inner) = fs.upgrade() else { return };
        readahead_one(&inner, ino, first, n);
        inner.ra_pending.fetch_sub(1, Ordering::Release);
    }
}

fn readahead_one(inner: &FsInner, ino: u64, first: u64, n: u64) {
    // Pages are inserted under the inode lock (as a reader: a truncate cannot run
    // between the size check and the insert, and finds them in the cache after it),
    // and read without it.
    let new: Vec<Arc<Page>> = {
        let _g = inner.locks.read(ino);
        let size = match inner.meta.lock().inode(ino) {
            Ok(node) => node.d.size,
            Err(_) => return,
        };
        let n = n.min(size.div_ceil(BLOCK).saturating_sub(first));
        inner.cache.read_ahead_range(ino, first, n).into_iter().filter(|p| p.1).map(|p| p.0).collect()
    };
    // A failed readahead fails its pages; the reader fetches them again.
    if let Err(e) = inner.fetch(ino, new) {
        tracing::debug!(ino, first, "readahead failed: {e}");
    }
}

fn writeback_thread(fs: Weak<FsInner>, wake: Arc<(Mutex<bool>, Condvar)>, every: std::time::Duration) {
    loop {
        {
            let mut stop = wake.0.lock();
            if *stop {
                return;
            }
            wake.1.wait_for(&mut stop, every);
            if *stop {
                return;
            }
        }
        let Some(inner) = fs.upgrade() else { return };
        if inner.poisoned.lock().is_none() {
            // Errors poison the file system; the next caller sees them.
            if inner.kick.swap(false, Ordering::Relaxed) {
                // Write back until well under the limit, waking throttled writers
                // after every round.
                loop {
                    let r = inner.writeback();
                    // Under the lock the writers check under: no wake-up is lost.
                    drop(inner.throttle.0.lock());
                    inner.throttle.1.notify_all();
                    if let Err(e) = &r {
                        tracing::error!("background write-back failed: {e}");
                    }
                    if r.is_err() || inner.pressure() < 0.25 {
                        break;
                    }
                }
            } else if let Err(e) = inner.commit() {
                tracing::error!("periodic commit failed: {e}");
            }
        }
    }
}

impl FsInner {
    pub fn check_writable(&self) -> Result<()> {
        if self.config.read_only {
            return Err(Error::read_only("mounted read-only"));
        }
        if let Some(why) = &*self.poisoned.lock() {
            return Err(Error::read_only(format!("file system is read-only after an I/O error: {why}")));
        }
        Ok(())
    }

    /// Turn read-only after a failed write or flush; returns the error to report.
    pub fn poison(&self, e: Error) -> Error {
        let mut p = self.poisoned.lock();
        if p.is_none() {
            tracing::error!(device = self.dev.name(), "file system turns read-only: {e}");
            *p = Some(e.to_string());
        }
        if e.kind == ErrorKind::NoSpace {
            return e;
        }
        Error::io(e.detail)
    }

    /// Note a read of `len` bytes at `offset`. A reader that continues where it left
    /// off is sequential: keep up to five windows of pages ahead of it queued for the
    /// background readers, in requests of two windows, so that two requests are in
    /// flight while the reader copies (measured: one window ahead left the device
    /// idle between requests; see docs/BENCHMARKS.md).
    pub fn readahead(&self, ino: u64, offset: u64, len: u64, size: u64) {
        // Up to five windows may be queued ahead: keep them well inside the cache, or
        // readahead evicts what the reader is about to read.
        let cap = (self.cache.capacity() as u64 / 16).max(1);
        let window = self.config.readahead_pages.min(cap).max(len.div_ceil(BLOCK));
        if self.config.readahead_pages == 0 {
            return;
        }
        let end = (offset + len).div_ceil(BLOCK);
        let queue = {
            let mut ra = self.ra_next.lock();
            if ra.len() > 4096 {
                ra.clear();
            }
            let (expected, frontier) = ra.get(&ino).copied().unwrap_or((u64::MAX, 0));
            let sequential = expected == offset;
            let mut frontier = if sequential { frontier.max(end) } else { end };
            let mut queue = None;
            if sequential && frontier < end + 5 * window && frontier * BLOCK < size {
                queue = Some((frontier, 2 * window));
                frontier += 2 * window;
            }
            ra.insert(ino, (offset + len, frontier));
            queue
        };
        if let Some((from, n)) = queue {
            if let Some(q) = &*self.ra_queue.lock() {
                self.ra_pending.fetch_add(1, Ordering::Relaxed);
                if q.send((ino, from, n)).is_err() {
                    self.ra_pending.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn shutdown(&self) -> Result<()> {
        self.ra_queue.lock().take();
        self.fetch_queue.lock().take();
        *self.wake.0.lock() = true;
        self.wake.1.notify_all();
        let me = std::thread::current().id();
        if let Some(h) = self.thread.lock().take() {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        // Their queues are closed: they finish what they hold and exit.
        for h in std::mem::take(&mut *self.helpers.lock()) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        if self.config.read_only || self.poisoned.lock().is_some() {
            return self.check_writable().or_else(|e| if self.config.read_only { Ok(()) } else { Err(e) });
        }
        self.commit()?;
        let _c = self.commit_lock.lock();
        let r = self.journal.lock().checkpoint(&*self.dev);
        r.map_err(|e| self.poison(e))?;
        self.meta.lock().pinned.clear();
        Ok(())
    }

    /// Free the inodes that lost their last name and handle, as many as fit in the
    /// running transaction; returns whether some are left for another one. Under the
    /// commit lock, so that write-back never places a page of a freed inode.
    fn free_unlinked(&self) -> Result<bool> {
        // Reopened by inode number, or relinked, meanwhile: it stays.
        let unlinked = |m: &mut Meta, ino: u64| -> Result<bool> {
            Ok(m.open.get(&ino).copied().unwrap_or(0) == 0 && m.inode(ino)?.d.nlink == 0)
        };
        let inos: Vec<u64> = self.meta.lock().to_free.iter().copied().collect();
        for ino in inos {
            {
                let mut m = self.meta.lock();
                m.to_free.remove(&ino);
                if !unlinked(&mut m, ino)? {
                    continue;
                }
            }
            // Without the metadata lock: a page being fetched is waited for.
            let dropped = self.cache.drop_from(ino, 0);
            self.forget_pages(dropped);
            let mut m = self.meta.lock();
            if !unlinked(&mut m, ino)? {
                continue;
            }
            let cost = m.free_cost(ino)?;
            if m.tx_size().plus(cost).log_blocks() > self.tx_cap {
                // Too big for what is left of this transaction: freed in the next
                // one, or, if it is too big for any, a part of it in each.
                let empty = m.tx_is_empty();
                let trimmed = empty && m.trim_inode(ino, self.tx_cap)?;
                m.to_free.insert(ino);
                if empty && !trimmed {
                    if m.credits != meta::TxSize::default() {
                        // Room promised to operations in progress: a later commit.
                        return Ok(false);
                    }
                    return Err(Error::corrupt(format!("bug: inode {ino} cannot be freed within the journal")));
                }
                return Ok(true);
            }
            m.free_inode(ino)?;
        }
        Ok(false)
    }

    /// Unlinked inodes found at mount (their last handle went away in a crash) are
    /// freed by the first commit.
    fn free_orphans(&self) -> Result<usize> {
        let mut m = self.meta.lock();
        let mut n = 0;
        for ino in m.used_inodes() {
            if m.inode(ino)?.d.nlink == 0 {
                m.to_free.insert(ino);
                n += 1;
            }
        }
        Ok(n)
    }

    // ------------------------------------------------------------ commit

    pub fn commit(&self) -> Result<()> {
        self.check_writable()?;
        let _c = self.commit_lock.lock();
        self.commit_locked()
    }

    /// Write back data, then log metadata. The caller holds the commit lock. Freeing
    /// unlinked inodes may take several transactions.
    pub fn commit_locked(&self) -> Result<()> {
        loop {
            self.check_writable()?;
            let more = self.free_unlinked().map_err(|e| self.poison(e))?;
            self.commit_once()?;
            if !more {
                return Ok(());
            }
        }
    }

    fn commit_once(&self) -> Result<()> {
        let wrote = self.writeback_locked()?;
        let (tx, frees) = {
            let mut m = self.meta.lock();
            m.take_tx().map_err(|e| self.poison(e))?
        };
        let logged: Vec<u64> = tx.images.iter().map(|(b, _)| *b).collect();
        if tx.is_empty() {
            if wrote {
                self.dev.flush().map_err(|e| self.poison(e.into()))?;
            }
            self.meta.lock().alloc.release(frees);
            return Ok(());
        }
        let mut j = self.journal.lock();
        let before = j.stats.checkpoints;
        j.commit(&*self.dev, tx).map_err(|e| self.poison(e))?;
        let checkpointed = j.stats.checkpoints != before;
        drop(j);
        let mut m = self.meta.lock();
        if checkpointed {
            m.pinned.clear();
        }
        m.pinned.extend(logged);
        m.alloc.release(frees);
        Ok(())
    }

    /// Commit if the running transaction is getting too big for the journal, or if
    /// too much of the cache is dirty (the caller waits: write throttling). At half
    /// that much dirty data, wake the write-back thread instead, so that the device
    /// writes while the caller goes on filling the cache.
    pub fn maybe_commit(&self) -> Result<()> {
        // A quarter of the journal: commits stay short, and the log holds several
        // before a checkpoint. (Only the metadata lock is taken here: a commit in
        // flight holds the journal lock across its I/O.)
        let big = self.meta.lock().tx_size().log_blocks() >= (self.tx_cap / 4).max(4);
        if big {
            return self.commit();
        }
        let pressure = self.pressure();
        if pressure >= 0.5 && !self.kick.swap(true, Ordering::Relaxed) {
            self.wake.1.notify_all();
        }
        if pressure >= 1.0 {
            if self.config.writeback_interval.is_none() {
                return self.writeback();
            }
            // Throttle: wait for the write-back thread to bring dirty data under the
            // limit (so the device keeps writing while this writer waits), or do it
            // here if that takes too long.
            let mut g = self.throttle.0.lock();
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(200);
            while self.pressure() >= 1.0 {
                self.kick.store(true, Ordering::Relaxed);
                self.wake.1.notify_all();
                if self.throttle.1.wait_until(&mut g, deadline).timed_out() {
                    drop(g);
                    return self.writeback();
                }
            }
        }
        Ok(())
    }

    /// How full the cache is of changes not yet written: dirty pages against the
    /// dirty limit, or patch bytes against patch memory, whichever is fuller (1.0 is
    /// at the limit). Write-back starts at 0.5 and writers wait at 1.0; a Lazy fetch
    /// happens here, under patch-memory pressure.
    pub fn pressure(&self) -> f64 {
        let limit = self.cache.capacity() as f64 * self.config.dirty_ratio;
        let dirty = self.dirty_pages() as f64 / limit;
        let patches =
            self.stats.patch_bytes.load(Ordering::Relaxed).max(0) as f64 / self.config.patch_bytes.max(1) as f64;
        dirty.max(patches)
    }

    /// Dirty pages that hold a page buffer (pages with only patches are bounded by
    /// patch memory instead).
    pub fn dirty_pages(&self) -> usize {
        let patched = self.stats.patched_pages.load(Ordering::Relaxed).max(0) as usize;
        self.cache.dirty_count().saturating_sub(patched)
    }

    /// Write dirty data home without committing: frees the cache for more writes.
    /// Ordered mode holds, since the data goes out before any commit that maps it.
    pub fn writeback(&self) -> Result<()> {
        self.check_writable()?;
        let _c = self.commit_lock.lock();
        self.writeback_locked().map(|_| ())
    }

    /// Write every dirty page home, allocating blocks for unmapped pages. Returns
    /// whether anything was written. The caller holds the commit lock.
    pub(crate) fn writeback_locked(&self) -> Result<bool> {
        let pages = self.cache.take_dirty();
        if pages.is_empty() {
            return Ok(false);
        }
        // Pages with patches get their data first (a failed fetch is remembered for the
        // file's next fsync; its page is dropped and not written).
        let mut by_ino: std::collections::BTreeMap<u64, Vec<Arc<Page>>> = Default::default();
        for p in &pages {
            if p.lock().state == crate::cache::PageState::Outdated {
                by_ino.entry(p.key.0).or_default().push(p.clone());
            }
        }
        for (ino, ps) in by_ino {
            let _ = self.resolve(ino, ps);
        }
        // Then wait for every page another thread is fetching — including one the
        // fetcher claimed between the look above and `resolve` — so that all of them
        // are written now: an fsync must not return before they are.
        for p in &pages {
            drop(p.wait());
        }
        // Pages are prepared (mapped, allocated, turned into requests) a chunk at a
        // time, while the device writes the chunks before: the bookkeeping of write-back
        // overlaps its I/O instead of leaving the device idle.
        const CHUNK: usize = 2048;
        let mut pages = pages.into_iter();
        let mut written: Vec<Arc<Page>> = Vec::new();
        let mut mapped = Ok(());
        let mut next = || -> Option<Vec<Op>> {
            while mapped.is_ok() {
                let chunk: Vec<Arc<Page>> = pages.by_ref().take(CHUNK).collect();
                if chunk.is_empty() {
                    return None;
                }
                let ops = self.prepare_writeback(chunk, &mut written, &mut mapped);
                if !ops.is_empty() {
                    return Some(ops);
                }
            }
            None
        };
        let done = self.dev.submit_stream(&mut next);
        self.stats.data_writes.fetch_add(written.len() as u64, Ordering::Relaxed);
        let mut result = mapped;
        let mut written = written.into_iter();
        for d in done {
            if let Err(e) = d.result {
                result = Err(e.into());
            }
            // Buffers come back even on error; the pages get them back either way.
            for buf in d.bufs {
                written.next().expect("one page per buffer").end_writeback(buf);
            }
        }
        result.map_err(|e| self.poison(e))?;
        Ok(true)
    }

    /// Lend the buffers of `chunk`'s dirty pages to write-back, place them (allocating
    /// blocks as contiguous runs) and build the write requests; `written` receives the
    /// pages in the order of the requests' buffers. Pages that need no write get their
    /// buffers back at once.
    fn prepare_writeback(
        &self,
        chunk: Vec<Arc<Page>>,
        written: &mut Vec<Arc<Page>>,
        mapped: &mut Result<()>,
    ) -> Vec<Op> {
        let mut items: Vec<(Arc<Page>, AlignedBuf)> = Vec::with_capacity(chunk.len());
        for p in chunk {
            match p.begin_writeback() {
                Some(buf) => items.push((p, buf)),
                // Not writable now but still holding unwritten changes (it got patches
                // again meanwhile): it stays dirty for the next write-back.
                None => {
                    let g = p.lock();
                    let pending =
                        matches!(g.state, crate::cache::PageState::Outdated | crate::cache::PageState::Fetching);
                    if pending && !g.failed {
                        drop(g);
                        self.cache.mark_dirty(p.key);
                    }
                }
            }
        }
        // A page dropped from the cache meanwhile (truncate, delete) has nothing to write.
        let held = self.cache.holds_all(items.iter().map(|i| &i.0));
        let mut unplaced = Vec::new();
        let mut kept = Vec::with_capacity(items.len());
        for (item, h) in items.into_iter().zip(held) {
            if h {
                kept.push(item);
            } else {
                unplaced.push(item);
            }
        }
        let mut placed: Vec<(u64, Arc<Page>, AlignedBuf)> = Vec::with_capacity(kept.len());
        {
            let mut m = self.meta.lock();
            let mut items = kept.into_iter().peekable();
            while let Some(first) = items.next() {
                let (ino, idx) = first.0.key;
                let mut run = vec![first];
                while items.peek().is_some_and(|(p, _)| p.key == (ino, idx + run.len() as u64)) {
                    run.push(items.next().expect("peeked"));
                }
                let phys = match self.map_run(&mut m, ino, idx, run.len() as u64) {
                    Ok(v) => v,
                    Err(e) => {
                        *mapped = Err(e);
                        unplaced.extend(run);
                        unplaced.extend(items.by_ref());
                        break;
                    }
                };
                for ((p, buf), b) in run.into_iter().zip(phys) {
                    match b {
                        Some(b) => placed.push((b, p, buf)),
                        // Truncated or deleted meanwhile: nothing to write.
                        None => unplaced.push((p, buf)),
                    }
                }
            }
        }
        unplaced.into_iter().for_each(|(p, buf)| p.end_writeback(buf));
        placed.sort_by_key(|p| p.0);
        let mut ops: Vec<Op> = Vec::new();
        let mut last: Option<u64> = None;
        for (b, page, buf) in placed {
            match (ops.last_mut(), last) {
                (Some(op), Some(l)) if l + 1 == b && op.bufs.len() < 256 => op.bufs.push(buf),
                _ => ops.push(Op { kind: OpKind::Write, offset: b * BLOCK, bufs: vec![buf] }),
            }
            last = Some(b);
            written.push(page);
        }
        ops
    }

    /// Device blocks for `n` consecutive pages of `ino` from `idx`, allocating the
    /// unmapped ones; None for pages past the end of the file or of a freed inode.
    fn map_run(&self, m: &mut Meta, ino: u64, idx: u64, n: u64) -> Result<Vec<Option<u64>>> {
        let Ok(node) = m.inode(ino) else {
            return Ok(vec![None; n as usize]);
        };
        let pages = node.d.size.div_ceil(BLOCK);
        let mut out = Vec::with_capacity(n as usize);
        let mut k = 0;
        while k < n {
            let lblk = idx + k;
            let node = m.inode(ino)?;
            if lblk >= pages {
                out.push(None);
                k += 1;
                continue;
            }
            if let Some(b) = node.map(lblk) {
                out.push(Some(b));
                k += 1;
                continue;
            }
            // Unmapped: allocate as much of the rest of the run as is unmapped.
            let mut want = 1;
            while k + want < n && idx + k + want < pages && node.map(idx + k + want).is_none() {
                want += 1;
            }
            let goal = lblk.checked_sub(1).and_then(|p| node.map(p)).map(|b| b + 1);
            let (first, got) = m.alloc_data(want, goal)?;
            let node = m.inode(ino)?;
            node.add_mapping(lblk, first, got);
            let mut unreserved = 0;
            for i in 0..got {
                if node.reserved.remove(&(lblk + i)) {
                    unreserved += 1;
                }
            }
            m.reserved -= unreserved;
            m.mark_inode_dirty(ino);
            m.data_meta_dirty.insert(ino);
            for i in 0..got {
                out.push(Some(first + i));
            }
            k += got;
        }
        Ok(out)
    }

    // ------------------------------------------------------------ page fetch

    /// A fetch failed: waiters get EIO, the page leaves the cache, and if writes had
    /// already returned with patches on it, the file's next fsync reports the loss.
    fn fail_page(&self, ino: u64, page: &Page) {
        // The patches are taken, so that no one settles them a second time (a truncate
        // that waited for this page).
        let lost = std::mem::take(&mut page.lock().patches).iter().map(|p| p.data.len()).sum();
        if lost > 0 {
            self.settle_patches(lost);
            self.fetch_errors.lock().insert(ino);
        }
        self.cache.fail(page);
    }

    /// A page's patches (`bytes`, 0 if it had none) leave patch memory: applied to its
    /// data (under the page lock, before the page becomes readable), dropped with the
    /// page, or lost with a failed fetch.
    fn settle_patches(&self, bytes: usize) {
        if bytes > 0 {
            self.stats.patch_bytes.fetch_sub(bytes as i64, Ordering::Relaxed);
            self.stats.patched_pages.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Settle the patch accounting of pages dropped from the cache (truncate, delete).
    pub fn forget_pages(&self, pages: Vec<Arc<Page>>) {
        for p in pages {
            // A page the fetcher or readahead is reading (they hold no inode lock
            // during I/O) is waited for; taking its patches means a fetch that claims
            // it later applies nothing and nothing is counted twice.
            let patches = std::mem::take(&mut p.wait().patches);
            self.settle_patches(patches.iter().map(|p| p.data.len()).sum());
        }
    }

    /// Fetch the data of pages that hold patches, apply the patches, and make them
    /// ordinary dirty pages. Pages already being fetched are waited for.
    pub fn resolve(&self, ino: u64, pages: Vec<Arc<Page>>) -> Result<()> {
        let claimed = self.claim(pages);
        self.fetch(ino, claimed)
    }

    /// The pages that hold patches (Outdated), now Fetching and ours to fetch.
    pub fn claim(&self, pages: Vec<Arc<Page>>) -> Vec<Arc<Page>> {
        let mut claimed = Vec::new();
        for p in pages {
            let mut g = p.lock();
            if g.state == crate::cache::PageState::Outdated {
                g.state = crate::cache::PageState::Fetching;
                drop(g);
                claimed.push(p);
            }
        }
        claimed
    }

    /// Whether `n` more bytes of patches fit in the configured patch memory.
    pub fn patch_room(&self, n: usize) -> bool {
        self.stats.patch_bytes.load(Ordering::Relaxed) + n as i64 <= self.config.patch_bytes as i64
    }

    /// Queue a page with patches for the fetcher thread.
    pub fn queue_fetch(&self, ino: u64, idx: u64) {
        if let Some(q) = &*self.fetch_queue.lock() {
            let _ = q.send((ino, idx));
        }
    }

    /// Read the given freshly inserted (Fetching) pages of `ino` from the device, or
    /// zero-fill the ones that map to no block. A page whose read fails is failed; the
    /// first error is returned.
    ///
    /// Pages go to the device and become readable a chunk at a time: a thread waiting
    /// for one page of a big fetch (write-back resolving every patched page under Lazy)
    /// waits for its chunk, not for the whole fetch.
    pub fn fetch(&self, ino: u64, mut pages: Vec<Arc<Page>>) -> Result<()> {
        const CHUNK: usize = 256;
        let mut result = Ok(());
        while !pages.is_empty() {
            let rest = pages.split_off(pages.len().min(CHUNK));
            let r = self.fetch_chunk(ino, std::mem::replace(&mut pages, rest));
            if result.is_ok() {
                result = r;
            }
        }
        result
    }

    fn fetch_chunk(&self, ino: u64, pages: Vec<Arc<Page>>) -> Result<()> {
        let maps: Result<Vec<Option<u64>>> = {
            let mut m = self.meta.lock();
            m.inode(ino).map(|node| pages.iter().map(|p| node.map(p.key.1)).collect())
        };
        let maps = match maps {
            Ok(v) => v,
            Err(e) => {
                pages.iter().for_each(|p| self.fail_page(ino, p));
                return Err(e);
            }
        };
        let mut ops: Vec<Op> = Vec::new();
        let mut owners: Vec<Vec<usize>> = Vec::new();
        let mut last: Option<u64> = None;
        for (i, (p, b)) in pages.iter().zip(&maps).enumerate() {
            let Some(b) = *b else {
                let g = p.lock();
                self.settle_patches(g.patch_bytes());
                p.complete(g, self.dev.alloc_zeroed(BLOCK_SIZE));
                last = None;
                continue;
            };
            let buf = self.dev.alloc(BLOCK_SIZE);
            match (ops.last_mut(), last) {
                (Some(op), Some(l)) if l + 1 == b && op.bufs.len() < 256 => {
                    op.bufs.push(buf);
                    owners.last_mut().expect("paired").push(i);
                }
                _ => {
                    ops.push(Op { kind: OpKind::Read, offset: b * BLOCK, bufs: vec![buf] });
                    owners.push(vec![i]);
                }
            }
            last = Some(b);
        }
        self.stats.data_reads.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let mut err = None;
        for (d, own) in self.dev.submit(ops).into_iter().zip(owners) {
            match d.result {
                Ok(()) => {
                    for (buf, i) in d.bufs.into_iter().zip(own) {
                        let g = pages[i].lock();
                        self.settle_patches(g.patch_bytes());
                        pages[i].complete(g, buf);
                    }
                }
                Err(e) => {
                    for i in own {
                        self.fail_page(ino, &pages[i]);
                    }
                    err = Some(Error::from(e));
                }
            }
        }
        err.map_or(Ok(()), Err)
    }
}
