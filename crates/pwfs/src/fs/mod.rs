//! fs: the file system — namespace, inodes, directories, and file I/O entry points.
//!
//! - `api`: the path-based Rust API (`Fs::open`, `File`, `OpenOptions`, ...).
//! - `ops`: inode-level operations, used by `api` and by front ends (FUSE).
//! - `perm`: the permission rules the engine applies (set-id bits, set-group-ID
//!   directories, POSIX ACLs); checking permissions is the front end's (the kernel's).
//! - `meta`: metadata blocks, inodes, directory indexes and the allocators, under one
//!   mutex; `mkfs`: formatting and the superblock; this module: mount, unmount and the
//!   shared state (`FsInner`) that `commit`, `writeback`, `nbw` and `readahead` work on.
//!
//! Commit protocol (ordered mode; docs/FORMAT.md walks the crash cases): under the
//! commit lock, write back dirty data (allocating its blocks: delayed allocation),
//! wait for it, close the metadata transaction, log it, flush, write the commit
//! block, flush. Blocks freed by the transaction become reusable only after that.
//! Any failed device write or flush poisons the file system: it turns read-only and
//! every later change fails with EROFS, so a lost write is never reported as success.
//!
//! Two switches a front end turns at run time: [`Fs::set_read_only`] (a remount
//! read-only: everything is committed and the image marked clean, then changes fail
//! with EROFS until it is turned back) and [`Fs::go_down`] (a shutdown for crash tests,
//! XFS_IOC_GOINGDOWN: the device is cut off as by a power cut, and everything fails
//! with EIO from then on; the next mount recovers from the journal).

pub mod api;
mod attrflags;
pub(crate) mod inode;
pub(crate) mod meta;
mod mkfs;
mod mount;
mod ops;
pub mod perm;
mod space;
pub(crate) mod tx;

use crate::cache::PageCache;
use crate::config::{Config, FetchPolicy};
use crate::device::Device;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self as f, Superblock, BLOCK};
use crate::journal::{self, Journal};
use meta::Meta;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use api::{DirEntry, File, FileType, Metadata, OpenOptions, PrivChange, SetAttr, StatFs};
pub use attrflags::{FS_APPEND_FL, FS_IMMUTABLE_FL, FS_NOATIME_FL};
pub use mkfs::{mkfs, mkfs_with_progress, read_superblock, MkfsOptions};
pub use perm::Creator;
pub use space::{
    FALLOC_FL_COLLAPSE_RANGE, FALLOC_FL_INSERT_RANGE, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE,
};

/// A mounted file system. Cheap to clone; the last handle (open `File`s included)
/// to go away flushes and empties the journal, as `unmount` does explicitly.
pub struct Fs {
    pub(crate) inner: Arc<FsInner>,
}

/// Handles are counted apart from the background threads' references: the last
/// handle to go (an `Fs` or a `File`) unmounts right there, synchronously, even while
/// a background thread holds the file system for a moment.
impl Clone for Fs {
    fn clone(&self) -> Fs {
        self.inner.handles.fetch_add(1, Ordering::AcqRel);
        Fs { inner: self.inner.clone() }
    }
}

impl Drop for Fs {
    fn drop(&mut self) {
        if self.inner.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Err(e) = self.inner.shutdown() {
                tracing::error!("unmount when the last handle went: {e}");
            }
        }
    }
}

pub(crate) struct FsInner {
    /// The device, behind `gate`.
    pub(crate) dev: Arc<dyn Device>,
    /// Closed by `go_down`: from then on no op reaches the medium.
    pub(crate) gate: Arc<crate::device::gate::Gate>,
    /// Shut down (`go_down`): every operation fails with EIO, unmount writes nothing.
    pub(crate) down: std::sync::atomic::AtomicBool,
    /// Remounted read-only (`set_read_only`): changes fail with EROFS; commits of what
    /// was written before still run.
    pub(crate) remounted_ro: std::sync::atomic::AtomicBool,
    pub(crate) sb: Superblock,
    pub(crate) config: Config,
    pub(crate) meta: crate::lock::SpinMutex<Meta>,
    pub(crate) journal: Mutex<Journal>,
    /// The most log blocks one transaction may take (the journal's log): operations
    /// are admitted only while the running transaction, with what they add, fits.
    pub(crate) tx_cap: u64,
    pub(crate) cache: PageCache,
    /// Inodes in memory, reached by the data path without the metadata lock.
    pub(crate) inodes: Arc<inode::InodeTable>,
    /// The running transaction's bookkeeping.
    pub(crate) tx: Arc<tx::Tx>,
    /// The hitchhiking buffer (mechanism 3).
    pub(crate) hitch: Arc<crate::hitchhike::Hitchhike>,
    /// Serializes write-back, commit, and block freeing (see `lock` for the order).
    pub(crate) commit_lock: Mutex<()>,
    /// Commits begun and completed (`commit_locked`), for group commit.
    pub(crate) commits_begun: std::sync::atomic::AtomicU64,
    pub(crate) commits_done: std::sync::atomic::AtomicU64,
    /// Orders a write that grows a file (its pages marked dirty, then its size
    /// published: shared) against a commit's choice of data and its closing of the
    /// transaction (exclusive): a commit stores no size whose data it did not see
    /// dirty. Shared per CPU: taking it costs a writer no shared cache line.
    pub(crate) size_gate: crate::lock::FileLock,
    /// Data was written back since the last flush (`take_unflushed`).
    pub(crate) unflushed: std::sync::atomic::AtomicBool,
    /// Files of fsyncs waiting for a commit: the next commit writes their data.
    pub(crate) fsync_files: Mutex<std::collections::BTreeSet<u64>>,
    pub(crate) poisoned: Mutex<Option<String>>,
    /// Live `Fs` handles (`File`s hold one each).
    pub(crate) handles: AtomicU64,
    /// The superblock's clean flag on the medium (cleared before the first change).
    pub(crate) clean: mount::CleanFlag,
    /// Whether `poisoned` holds a reason (checked on every change without its lock).
    pub(crate) is_poisoned: std::sync::atomic::AtomicBool,
    /// Stop flag and wake-up of the write-back thread (shared, so that it waits
    /// without keeping the file system alive).
    pub(crate) wake: Arc<(Mutex<bool>, Condvar)>,
    /// The write-back thread was woken for dirty data (not by its timer).
    pub(crate) kick: std::sync::atomic::AtomicBool,
    /// The running transaction has grown past a quarter of the journal: the
    /// write-back thread commits it.
    pub(crate) commit_due: std::sync::atomic::AtomicBool,
    /// Writers over the dirty limit wait here for the write-back thread.
    pub(crate) throttle: (Mutex<()>, Condvar),
    pub(crate) thread: Mutex<Option<JoinHandle<()>>>,
    /// Readahead and fetcher threads: joined at shutdown, so that none of them still
    /// holds the file system (and its device, and the image lock) after an unmount.
    pub(crate) helpers: Mutex<Vec<JoinHandle<()>>>,
    /// The background readers' queue.
    pub(crate) ra_queue: Mutex<Option<std::sync::mpsc::Sender<crate::readahead::RaRequest>>>,
    /// Readahead requests queued or being read.
    pub(crate) ra_pending: AtomicU64,
    /// Pages with patches for the fetcher thread (AsyncForeground/AsyncBackground).
    pub(crate) fetch_queue: Mutex<Option<std::sync::mpsc::Sender<crate::nbw::FetchMsg>>>,
    /// Fetches the fetcher thread left to `shutdown` (the file system was being dropped).
    pub(crate) fetch_leftover: crate::nbw::Leftover,
    /// Files whose patches were lost to a failed fetch after their writes returned:
    /// each handle's next fsync (or close) reports EIO once (`LostWrites`).
    pub(crate) fetch_errors: Mutex<std::collections::HashMap<u64, LostWrites>>,
    /// Write-backs begun so far (`InodeCell::dirtied_in`).
    pub(crate) wb_round: AtomicU64,
    /// Whether `fetch_errors` ever held anything: opens, closes and fsyncs skip its
    /// lock while it has not (the usual case).
    pub(crate) any_lost: std::sync::atomic::AtomicBool,
    /// Told of every page whose acknowledged writes were lost (`Fs::on_lost_writes`).
    pub(crate) lost_writes: std::sync::OnceLock<LostWritesHook>,
    pub(crate) stats: FsStats,
    /// Where read misses and fsyncs spend their time (`Config::trace_io`).
    pub(crate) times: crate::aios::Times,
}

/// See `Fs::on_lost_writes`.
pub(crate) type LostWritesHook = Box<dyn Fn(u64, u64) + Send + Sync>;

/// Writes of a file lost after they returned, as Linux's errseq_t keeps write-back
/// errors: `seq` counts the losses, and each handle remembers the count it last
/// reported (`File::lost_seen`), so that every handle open when a loss happens reports
/// it once at its next fsync (or close), and so does a handle opened after it while
/// no one has reported it yet (`seen`).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LostWrites {
    pub seq: u64,
    pub seen: bool,
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

impl Fs {
    /// Mount a formatted device: check the superblock, replay the journal, free orphans.
    pub fn mount(dev: Arc<dyn Device>, config: Config) -> Result<Fs> {
        Fs::mount_report(dev, config).map(|(fs, _)| fs)
    }

    pub fn mount_report(dev: Arc<dyn Device>, config: Config) -> Result<(Fs, MountReport)> {
        config.validate()?;
        if config.trace_io {
            crate::aios::enable_tracing();
        }
        let gate = Arc::new(crate::device::gate::Gate::new(dev));
        let mut dev: Arc<dyn Device> = gate.clone();
        let (mut sb, used_backup) = read_superblock(&*dev)?;
        let checked = mount::needs_check(&sb, &config);
        if checked {
            // Before anything is written: a damaged image is refused unchanged.
            mount::check(&*dev)?;
        }
        // A damaged primary superblock (a torn write of the upgrade below, a bad
        // sector) is rewritten from the backup by a writable mount once the full check
        // has passed, as e2fsck does; without that check it is left for fsck to report
        // and this mount writes no superblock.
        let restored = used_backup && checked && !config.read_only && mount::restore_primary(&*dev, &sb)?;
        let on_backup = used_backup && !restored;
        // The journal is read and its replay worked out before anything is written:
        // a log that cannot be replayed (a delta without its base) refuses the image
        // unchanged, upgrade and state word included.
        let scan = journal::scan(&*dev, &sb)?;
        let plan = journal::plan(&scan)?;
        if !config.read_only && !on_backup && sb.version < f::VERSION {
            mount::upgrade(&*dev, &mut sb)?;
        }
        let clean = mount::CleanFlag::new(&sb, on_backup, config.read_only);
        let mut report = MountReport {
            used_backup_superblock: used_backup,
            transactions_replayed: scan.transactions.len(),
            ..Default::default()
        };
        let preloaded = if config.read_only {
            // Blocks the journal would write home are read from it: metadata through
            // `Meta`'s preloaded images, file data (hitchhiked blocks) through the
            // device, which the overlay answers for them.
            if !plan.is_empty() {
                dev = Arc::new(crate::device::overlay::Overlay::new(dev, plan.clone()));
            }
            plan
        } else {
            if !scan.transactions.is_empty() {
                clean.before_change(&*dev, &sb)?;
            }
            report.blocks_replayed = journal::replay_planned(&*dev, &sb, &scan, plan)?;
            Default::default()
        };
        // After a crash, the log starts one sequence number past the last one
        // replayed: the asynchronous stack writes a commit block beside its body, so a
        // torn transaction may have left a whole commit block of that number in the
        // log, which a new transaction of the same number could otherwise meet where
        // its own commit block has not landed (its body checksum alone would tell
        // them apart).
        let mut next_seq = scan.next_seq();
        if !config.read_only && !sb.clean {
            next_seq += 1;
            journal::write_header(&*dev, sb.journal_start, next_seq)?;
        }
        let inodes = Arc::new(inode::InodeTable::default());
        let tx = Arc::new(tx::Tx::new(sb.block_bitmap_blocks));
        let mut meta = Meta::load(sb.clone(), dev.clone(), preloaded, inodes.clone(), tx.clone())?;
        // Deltas only on an image that says version 2 (a mount that fell back on a
        // version-1 backup superblock does not upgrade it, and a version-1 build would
        // misread them).
        let deltas = config.hitchhike && !config.read_only && sb.version >= 2;
        let journal = Journal::new(&sb, next_seq).with_deltas(deltas);
        let hitch = Arc::new(crate::hitchhike::Hitchhike::new(
            deltas,
            config.hitchhike_blocks.min((config.cache_bytes / BLOCK / 4) as usize),
            journal.capacity(),
            crate::commit::admission_room(journal.capacity()).saturating_sub(sb.block_bitmap_blocks + 32),
        ));
        meta.hitch = hitch.clone();
        let inner = Arc::new(FsInner {
            tx_cap: journal.capacity(),
            journal: Mutex::new(journal),
            cache: PageCache::new((config.cache_bytes / BLOCK) as usize),
            dev,
            gate,
            down: Default::default(),
            remounted_ro: Default::default(),
            sb,
            meta: crate::lock::SpinMutex::new(meta),
            inodes,
            tx,
            hitch,
            commit_lock: Mutex::new(()),
            commits_begun: Default::default(),
            commits_done: Default::default(),
            fsync_files: Default::default(),
            unflushed: Default::default(),
            size_gate: Default::default(),
            poisoned: Mutex::new(None),
            handles: AtomicU64::new(0),
            clean,
            is_poisoned: Default::default(),
            wake: Arc::new((Mutex::new(false), Condvar::new())),
            kick: Default::default(),
            commit_due: Default::default(),
            throttle: (Mutex::new(()), Condvar::new()),
            thread: Mutex::new(None),
            helpers: Mutex::new(Vec::new()),
            ra_queue: Mutex::new(None),
            ra_pending: AtomicU64::new(0),
            fetch_queue: Mutex::new(None),
            fetch_leftover: Default::default(),
            fetch_errors: Mutex::new(Default::default()),
            any_lost: std::sync::atomic::AtomicBool::new(false),
            wb_round: AtomicU64::new(0),
            lost_writes: std::sync::OnceLock::new(),
            stats: FsStats::default(),
            times: Default::default(),
            config,
        });
        // Until the mount has succeeded, a failure drops `inner` as a file system shut
        // down: nothing more is written (no final commit, checkpoint or clean mark) on
        // an image the mount refused or could not finish.
        struct Mounting<'a>(&'a FsInner, bool);
        impl Drop for Mounting<'_> {
            fn drop(&mut self) {
                if !self.1 {
                    self.0.down.store(true, Ordering::Release);
                }
            }
        }
        let mut mounting = Mounting(&inner, false);
        // The root must be a directory, with its links (the orphan scan would free a
        // root without any).
        {
            let mut m = inner.meta.lock();
            let root = m.inode(f::ROOT_INO)?;
            if !root.is_dir() {
                return Err(Error::corrupt("root inode is not a directory"));
            }
            if root.d.nlink < 2 {
                return Err(Error::corrupt(format!("root directory has link count {}", root.d.nlink)));
            }
        }
        if !inner.config.read_only {
            if mount::needs_orphan_scan(&inner.sb, &inner.config) {
                report.orphans_freed = inner.free_orphans()?;
            }
            inner.commit()?;
        }
        if let Some(every) = inner.config.writeback_interval.filter(|_| !inner.config.read_only) {
            let (weak, wake) = (Arc::downgrade(&inner), inner.wake.clone());
            let h = std::thread::Builder::new()
                .name("pwfs-writeback".into())
                .spawn(move || crate::writeback::writeback_thread(weak, wake, every))
                .map_err(|e| Error::io(format!("cannot start the write-back thread: {e}")))?;
            *inner.thread.lock() = Some(h);
        }
        if matches!(inner.config.fetch, FetchPolicy::AsyncForeground | FetchPolicy::AsyncBackground) {
            let (tx, rx) = std::sync::mpsc::channel();
            let (weak, leftover) = (Arc::downgrade(&inner), inner.fetch_leftover.clone());
            let h = std::thread::Builder::new()
                .name("pwfs-fetcher".into())
                .spawn(move || crate::nbw::fetcher_thread(weak, rx, leftover))
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
                    .spawn(move || crate::readahead::readahead_thread(weak, rx))
                    .map_err(|e| Error::io(format!("cannot start the readahead thread: {e}")))?;
                inner.helpers.lock().push(h);
            }
            *inner.ra_queue.lock() = Some(tx);
        }
        inner.handles.store(1, Ordering::Release);
        mounting.1 = true;
        drop(mounting);
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

    /// Why the file system turned read-only (or was shut down), if it did.
    pub fn poisoned(&self) -> Option<String> {
        self.inner.poisoned.lock().clone()
    }

    /// Whether `go_down` shut the file system down.
    pub fn is_down(&self) -> bool {
        self.inner.down.load(Ordering::Acquire)
    }

    /// Whether changes are refused: mounted read-only, remounted read-only
    /// (`set_read_only`), or turned read-only by an error.
    pub fn is_read_only(&self) -> bool {
        self.inner.check_writable().is_err()
    }

    /// A remount: `true` commits everything, empties the journal and marks the image
    /// clean (as an unmount does), then refuses every change with EROFS; `false` takes
    /// changes again (the clean mark is cleared before the next one reaches the
    /// medium). Data written before the switch is committed, not lost.
    pub fn set_read_only(&self, read_only: bool) -> Result<()> {
        let inner = &self.inner;
        if !read_only {
            inner.remounted_ro.store(false, Ordering::Release);
            return inner.check_writable();
        }
        if inner.config.read_only {
            return Ok(());
        }
        inner.remounted_ro.store(true, Ordering::Release);
        inner.settle()
    }

    /// Shut the file system down at once, as a power cut would (XFS_IOC_GOINGDOWN):
    /// [`GoingDown::NoLogFlush`] drops everything not yet durable; `Default` and
    /// `LogFlush` commit first (data, then the journal), as XFS flushes its log first.
    /// Then the device is cut off: no later op reaches the medium, every operation
    /// fails with EIO, and unmount writes nothing (the image is not marked clean; the
    /// next mount checks it and replays the journal). Shutting down twice is harmless.
    pub fn go_down(&self, mode: GoingDown) -> Result<()> {
        let inner = &self.inner;
        let flushed = match mode {
            GoingDown::NoLogFlush => None,
            GoingDown::Default | GoingDown::LogFlush => Some(inner.commit()),
        };
        inner.gate.close();
        inner.down.store(true, Ordering::Release);
        let why = format!("shut down ({mode:?}) on request");
        {
            let mut p = inner.poisoned.lock();
            if p.is_none() {
                *p = Some(why.clone());
                inner.is_poisoned.store(true, Ordering::Release);
            }
        }
        tracing::warn!(device = inner.dev.name(), "{why}");
        // Wake writers waiting on the write-back thread: they fail now.
        inner.throttle.1.notify_all();
        match flushed {
            Some(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }

    /// Have `f(ino, page index)` called for every page whose acknowledged writes are
    /// lost (a non-blocking write's patch whose page could not be read): a front end
    /// whose kernel caches the file drops its copy of the page, which still shows the
    /// written bytes. Called on the thread that saw the failure, maybe inside a
    /// request for the file: `f` must not block. Set once; later calls are ignored.
    pub fn on_lost_writes(&self, f: impl Fn(u64, u64) + Send + Sync + 'static) {
        let _ = self.inner.lost_writes.set(Box::new(f));
    }

    /// Commit everything (sync(2)).
    pub fn sync(&self) -> Result<()> {
        self.inner.sync_result(self.inner.commit())
    }

    /// Write dirty data home without committing, as the write-back thread does under
    /// dirty-data pressure: nothing is made durable by it (no flush, no journal).
    pub fn write_back(&self) -> Result<()> {
        self.inner.writeback()
    }

    /// One round of write-back under dirty-data pressure, as the write-back thread
    /// makes when the cache passes half its dirty limit: the files dirtied longest ago,
    /// as many as bring the dirty pages under a quarter of the limit (tests).
    #[doc(hidden)]
    pub fn write_back_under_pressure(&self) -> Result<()> {
        self.inner.writeback_pressure()
    }

    /// Drop every clean cached page (benchmarks use it for cold runs). Readahead
    /// still in flight is waited for first, so that it neither lands in the cache
    /// afterwards nor keeps the device busy for whoever runs next.
    pub fn evict_cache(&self) -> Result<()> {
        self.wait_readahead();
        self.inner.commit()?;
        self.inner.cache.evict_clean();
        Ok(())
    }

    /// Wait until no readahead is queued or running.
    pub fn wait_readahead(&self) {
        while self.inner.ra_pending.load(Ordering::Acquire) > 0 {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }

    /// Cache hits, misses and evictions by the CLOCK sweep.
    pub fn cache_stats(&self) -> (u64, u64, u64) {
        self.inner.cache.stats()
    }

    /// Cached pages dropped behind sequential streams the FUSE mount's kernel keeps.
    pub fn cache_dropped_behind(&self) -> u64 {
        self.inner.cache.dropped_behind()
    }

    /// Where the time of read misses and fsyncs went, summed (all zero unless the
    /// mount has `Config::trace_io`).
    pub fn io_times(&self) -> crate::aios::IoTimes {
        self.inner.times.get()
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

    /// Requests this mount passed to its device.
    pub fn device_counters(&self) -> crate::device::gate::DeviceCounters {
        self.inner.gate.counters()
    }

    /// Hitchhiking counters (mechanism 3).
    pub fn hitchhike_stats(&self) -> crate::hitchhike::HitchhikeStats {
        let j = self.inner.journal.lock().stats;
        self.inner.hitch.stats(&j)
    }

    pub fn journal_stats(&self) -> journal::JournalStats {
        self.inner.journal.lock().stats
    }
}

/// How `Fs::go_down` shuts down: the flags of XFS_IOC_GOINGDOWN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoingDown {
    /// XFS_FSOP_GOING_FLAGS_DEFAULT (0): XFS freezes (syncs) first; pwfs commits first.
    Default,
    /// XFS_FSOP_GOING_FLAGS_LOGFLUSH (1): the log flushed first; pwfs commits first
    /// (ordered mode: data is written back before the journal commit).
    LogFlush,
    /// XFS_FSOP_GOING_FLAGS_NOLOGFLUSH (2): nothing more is written, as a power cut.
    NoLogFlush,
}

impl GoingDown {
    /// From the ioctl's flags value (`None` for an unknown value: EINVAL).
    pub fn from_flags(flags: u32) -> Option<GoingDown> {
        match flags {
            0 => Some(GoingDown::Default),
            1 => Some(GoingDown::LogFlush),
            2 => Some(GoingDown::NoLogFlush),
            _ => None,
        }
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

impl FsInner {
    /// The inode's cell: from the table, or loaded under the metadata lock.
    pub fn cell(&self, ino: u64) -> Result<Arc<inode::InodeCell>> {
        match self.inodes.get(ino) {
            Some(cell) => Ok(cell),
            None => self.meta.lock().cell(ino),
        }
    }

    /// Whether a change may be made: not mounted or remounted read-only, not poisoned,
    /// not shut down.
    pub fn check_writable(&self) -> Result<()> {
        self.check_alive()?;
        if self.remounted_ro.load(Ordering::Acquire) {
            return Err(Error::read_only("remounted read-only"));
        }
        Ok(())
    }

    /// Whether what was changed before may still be written back and committed (a
    /// remount read-only still commits it): not mounted read-only, not poisoned, not
    /// shut down (EIO then).
    pub fn check_alive(&self) -> Result<()> {
        if self.config.read_only {
            return Err(Error::read_only("mounted read-only"));
        }
        if self.is_poisoned.load(Ordering::Acquire) {
            if let Some(why) = &*self.poisoned.lock() {
                if self.down.load(Ordering::Acquire) {
                    return Err(Error::io(format!("file system {why}")));
                }
                return Err(Error::read_only(format!("file system is read-only after an I/O error: {why}")));
            }
        }
        Ok(())
    }

    /// What a call that asks for durability (fsync, fdatasync, sync) answers when the
    /// file system takes no changes: on a read-only mount nothing waits to be written
    /// (0, as Linux's fsync there); once an I/O error turned it read-only, EIO, not
    /// EROFS: changes acknowledged before may be lost, and callers read EROFS from
    /// fsync as "this file cannot be synced" and go on (ext4 reports the failed
    /// write-back as EIO).
    pub fn sync_result(&self, r: Result<()>) -> Result<()> {
        match r {
            Err(e) if e.kind == ErrorKind::ReadOnly && self.down.load(Ordering::Acquire) => Err(Error::io(e.detail)),
            Err(e) if e.kind == ErrorKind::ReadOnly && self.config.read_only => Ok(()),
            Err(e) if e.kind == ErrorKind::ReadOnly && self.is_poisoned.load(Ordering::Acquire) => {
                Err(Error::io(e.detail))
            }
            r => r,
        }
    }

    /// EIO once the file system was shut down (`go_down`); for operations that only read.
    pub fn check_up(&self) -> Result<()> {
        if self.down.load(Ordering::Acquire) {
            return self.check_alive();
        }
        Ok(())
    }

    /// Turn read-only after a failed write or flush; returns the error to report.
    pub fn poison(&self, e: Error) -> Error {
        let mut p = self.poisoned.lock();
        if p.is_none() {
            tracing::error!(device = self.dev.name(), "file system turns read-only: {e}");
            *p = Some(e.to_string());
            self.is_poisoned.store(true, Ordering::Release);
        }
        if e.kind == ErrorKind::NoSpace {
            return e;
        }
        Error::io(e.detail)
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
        // Reads writers started that the fetcher left (the file system was being
        // dropped): their pages are dirty, and the commit below waits for them.
        for f in std::mem::take(&mut *self.fetch_leftover.lock()) {
            if let Err(e) = self.finish_fetch(f) {
                tracing::warn!("fetch for non-blocking writes failed at unmount: {e}");
            }
        }
        if self.down.load(Ordering::Acquire) {
            // Shut down on purpose: the image stays as a power cut left it.
            return Ok(());
        }
        if self.config.read_only || self.poisoned.lock().is_some() {
            return self.check_alive().or_else(|e| if self.config.read_only { Ok(()) } else { Err(e) });
        }
        self.settle()
    }

    /// Commit everything, empty the journal, and mark the image clean unless an inode
    /// is unlinked but still open (unmount, remount read-only).
    fn settle(&self) -> Result<()> {
        self.commit()?;
        let _c = self.commit_lock.lock();
        let r = self.journal.lock().checkpoint(&*self.dev);
        r.map_err(|e| self.poison(e))?;
        self.hitch.checkpointed();
        let orphans = {
            let mut m = self.meta.lock();
            m.pinned.clear();
            let open: Vec<u64> =
                m.table.cells().into_iter().filter(|c| c.opens.load(Ordering::Acquire) > 0).map(|c| c.ino).collect();
            !m.to_free.is_empty() || open.into_iter().any(|ino| m.inode(ino).map_or(true, |n| n.d.nlink == 0))
        };
        if !orphans {
            // Journal empty, everything durable, no orphan: the next mount may trust it.
            self.clean.set_after_unmount(&*self.dev, &self.sb).map_err(|e| self.poison(e))?;
        }
        Ok(())
    }

    // ------------------------------------------------------------ commit

    // ------------------------------------------------------------ page fetch
}
