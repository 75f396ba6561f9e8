//! Configuration, and the off-switch of every mechanism (DESIGN.md §1).
//!
//! Mechanisms 1 (non-blocking writes), 3 (hitchhiking) and 4 (the asynchronous stack)
//! are built and on by default; 2 (range locks) and 5 (the direct path) are not yet:
//! each enum is the seam its mechanism plugs into, and asking for one not built is
//! refused at mount with EINVAL rather than silently ignored.

use std::time::Duration;

/// How a partial write to a page that is not cached gets its page (mechanism 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FetchPolicy {
    /// Read the page first, then write into it (the baseline, the off-switch).
    Blocking,
    /// The writer resolves the page's block and starts its read itself before it
    /// returns; the fetcher thread completes it (as in the paper).
    AsyncForeground,
    /// The fetcher thread fetches pages with patches soon after the write, in
    /// batches. The default: the fastest here (each read a writer starts on its own
    /// costs it a submission and the device a doorbell; the fetcher batches up to 256),
    /// with short pauses (Lazy pauses ~400 ms; docs/DECISIONS.md).
    #[default]
    AsyncBackground,
    /// Fetch only when needed: a read the patches cannot serve, write-back, fsync,
    /// truncate. A later full overwrite of the page cancels the fetch.
    Lazy,
}

/// How concurrent access to one file is ordered (mechanism 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LockMode {
    /// One reader-writer lock per inode (what ext4's i_rwsem does; the baseline).
    #[default]
    Inode,
    Range,
}

/// Which path a data request takes (mechanism 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoPath {
    #[default]
    Buffered,
    Direct,
    Auto,
}

/// How the I/O stack orders CPU work and device I/O (mechanism 4, `aios.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Stack {
    /// Each step waits for the one before it: a read miss makes its cache entry, then
    /// reads; a commit writes data, waits, writes the journal, waits, flushes, builds
    /// and writes the commit block, flushes. The baseline, the off-switch.
    Sync,
    /// Submit first, do the bookkeeping while the device works: a read miss submits
    /// before it makes its cache entries; a commit puts data and journal on the device
    /// together, builds the commit block meanwhile, flushes once and writes the commit
    /// block with FUA. The default: an fsync that commits takes 0.84-0.90x the time,
    /// reads are unchanged (docs/BENCHMARKS.md, bench aios).
    #[default]
    Async,
}

/// When a mount runs the full consistency check (fsck) before it writes anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MountCheck {
    /// When the image was not unmounted cleanly (its superblock does not say clean):
    /// after a crash, a failed unmount, or on an image from before the clean flag.
    /// A clean image mounts without reading more than its bitmaps; its metadata
    /// checksums are still verified as blocks are read.
    #[default]
    IfNotClean,
    /// On every mount (`pwfs mount --check`).
    Always,
    /// Never (tests, `pwfs info`, an image the caller has just checked). An image not
    /// unmounted cleanly still has its orphans freed.
    Never,
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Bytes of file data the page cache holds.
    pub cache_bytes: u64,
    /// Write-back starts when this fraction of the cache is dirty.
    pub dirty_ratio: f64,
    /// The write-back thread commits at least this often (None: no thread).
    pub writeback_interval: Option<Duration>,
    pub fetch: FetchPolicy,
    pub lock: LockMode,
    pub io_path: IoPath,
    /// How the I/O stack orders CPU work and device I/O (mechanism 4, `aios`).
    pub stack: Stack,
    /// Hybrid polling (io_uring engine): a thread waiting for a completion spins on
    /// the completion queue for a calibrated time (about the device's 4 KiB read
    /// latency) before it sleeps. Off by default: it costs a core while it spins.
    pub poll: bool,
    /// Measure where the time of read misses and fsyncs goes (`Fs::io_times`): two
    /// clock reads per request and per submission. Off by default.
    pub trace_io: bool,
    /// Carry small synchronous writes as compressed deltas in the journal's commit
    /// block (mechanism 3, `hitchhike.rs`). Off: every fsync'd block is written whole.
    pub hitchhike: bool,
    /// Most data blocks the hitchhiking buffer holds (their last durable versions);
    /// also bounded by a sixteenth of the journal.
    pub hitchhike_blocks: usize,
    /// Open read-only: no write reaches the device (not even journal recovery).
    pub read_only: bool,
    /// When to run the full consistency check (fsck) before mounting, refusing an
    /// image that fails it. It reads all metadata in use once.
    pub check_on_mount: MountCheck,
    /// Pages read ahead, in the background, of a sequential reader (0: none).
    pub readahead_pages: u64,
    /// Memory for non-blocking write patches; past it writes take the blocking path.
    pub patch_bytes: u64,
    /// Update access times on reads by the relatime rule (when the access time is not
    /// after the modification or change time, or a day old), except for files with the
    /// noatime flag. Off (noatime) by default: a read then never dirties metadata.
    pub atime: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            cache_bytes: 256 << 20,
            dirty_ratio: 0.5,
            writeback_interval: Some(Duration::from_secs(5)),
            fetch: FetchPolicy::AsyncBackground,
            lock: LockMode::Inode,
            io_path: IoPath::Buffered,
            stack: Stack::Async,
            poll: false,
            trace_io: false,
            hitchhike: true,
            hitchhike_blocks: 1024,
            read_only: false,
            check_on_mount: MountCheck::IfNotClean,
            readahead_pages: 256,
            patch_bytes: 64 << 20,
            atime: false,
        }
    }
}

impl Config {
    /// Refuse settings for mechanisms this build does not have yet.
    pub fn validate(&self) -> crate::Result<()> {
        let missing = |what: &str| Err(crate::Error::invalid(format!("{what} is not implemented yet")));
        if self.lock != LockMode::Inode {
            return missing("range locking");
        }
        if self.io_path != IoPath::Buffered {
            return missing("direct and adaptive I/O paths");
        }
        if self.cache_bytes < 64 * 4096 {
            return Err(crate::Error::invalid("cache must hold at least 64 pages"));
        }
        if !(0.05..=0.95).contains(&self.dirty_ratio) {
            return Err(crate::Error::invalid("dirty_ratio must be within 0.05..=0.95"));
        }
        Ok(())
    }
}
