//! pwfs-fuse: Patchwork as a FUSE file system, for unmodified programs.
//!
//! Interface: [`mount`] / [`mount_with`] serve a mounted [`pwfs::Fs`] at a mount point
//! until it is unmounted (or [`Mounted::unmount`] is called). Built on the public API
//! of `pwfs` only. Permissions are checked by the kernel (`default_permissions`).
//! Every engine errno reaches the program unchanged.
//!
//! How much the kernel caches is [`KernelCache`]: by default (`WriteThrough`) the
//! kernel's page cache serves clean data (`FOPEN_KEEP_CACHE`, no request for a cached
//! read) and every write still reaches the engine as it was made, `(offset, length)`,
//! before it returns (FUSE without the write-back cache never reads a page to fill a
//! partial write); `Off` opens data files `FOPEN_DIRECT_IO` (every read and write is a
//! request; writes of one file run in parallel). Attributes and names are cached for
//! [`TTL`]: every change goes through the kernel, which updates or drops its copy of
//! what it changed. See docs/DECISIONS.md.
//!
//! As root the mount is made here with mount(2) (type `fuse.pwfs`, the source the
//! image path or `fsname`, MS_* flags as asked) and served with `fuser::Session::from_fd`;
//! the mount's id in /proc/self/mountinfo is recorded, so that an unmount only ever
//! removes this mount, never what is under it or what replaced it. A remount
//! read-only or back (`mount -o remount,ro`) is seen in mountinfo and passed on to the
//! engine (`Fs::set_read_only`). The ioctl `XFS_IOC_GOINGDOWN` shuts the engine down
//! (`Fs::go_down`) for crash tests. Without root it falls back to fuser's mount
//! through `fusermount3`.

/// A message of the serving process on stderr, which may be a hung-up terminal or a
/// closed pipe: a failed write is dropped (`eprintln!` would panic and leave a dead
/// mount).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus,
    ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use pwfs::format::Timespec;
use pwfs::{Creator, Fs, Metadata, PrivChange, SetAttr, TimeSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long the kernel may cache attributes and names. Every change goes through the
/// kernel, which updates or drops its copy of what it changed; nothing changes the
/// file system behind its back (the LD_PRELOAD shim, when it comes, will invalidate
/// what it changes).
pub const TTL: Duration = Duration::from_secs(3600);

/// What the kernel caches of file data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelCache {
    /// Nothing: data files are opened `FOPEN_DIRECT_IO`, so every read and write is a
    /// request, and writes to one file from several threads run in parallel. A shared
    /// mapping of a file is refused (ENODEV): the kernel's pages behind it would not see
    /// the direct writes, and a store to a stale page would write it back over them
    /// (`FUSE_DIRECT_IO_ALLOW_MMAP` lost pwrites that way; tests/mmap.rs). Private
    /// mappings work.
    Off,
    /// Clean data in the kernel's page cache, kept across opens: a cached read is no
    /// request. Writes go through to the engine before they return, as made.
    #[default]
    WriteThrough,
    /// The kernel's write-back cache (`FUSE_WRITEBACK_CACHE`): writes are buffered in
    /// the kernel and reach the engine as whole pages when the kernel writes back; a
    /// partial write to a page not in the kernel's cache first reads the page (so
    /// non-blocking writes do not apply).
    WriteBack,
}

/// How to mount.
#[derive(Clone, Debug, Default)]
pub struct MountOptions {
    /// Let other users than the mounting one in.
    pub allow_other: bool,
    pub kernel_cache: KernelCache,
    /// The mount's source in /proc/mounts (mount(8)'s `fsname=`; the image path when
    /// mounted by `pwfs mount`); "pwfs" when `None`.
    pub fsname: Option<String>,
    /// Honour set-user-ID bits and device files (off: `nosuid`, `nodev`, as every FUSE
    /// mount gets by default; only root can turn them on).
    pub suid: bool,
    pub dev: bool,
    /// More mount(2) flags: `MS_RDONLY`, `MS_NOEXEC`, `MS_NOATIME`, `MS_NODIRATIME`,
    /// `MS_RELATIME`, `MS_STRICTATIME`, `MS_SYNCHRONOUS`, `MS_DIRSYNC`, `MS_LAZYTIME`.
    /// `MS_RDONLY` also turns the engine read-only (`Fs::set_read_only`).
    pub flags: libc::c_ulong,
    /// Threads serving requests (`None`: `default_threads`).
    pub threads: Option<usize>,
    /// Files also change behind the kernel's back (the LD_PRELOAD shim is served):
    /// keep track of what the kernel caches, to invalidate it ([`Mounted::view`]).
    pub shim: bool,
    /// Serve /dev/fuse only, even where the kernel offers FUSE over io_uring (the fuse
    /// module's `enable_uring`; by default requests then come through per-CPU rings,
    /// docs/DECISIONS.md).
    pub dev_fuse_only: bool,
}

/// The file system type in /proc/mounts: mount(8) runs `mount.fuse.pwfs` for it.
pub const FS_TYPE: &str = "fuse.pwfs";

/// `XFS_IOC_GOINGDOWN`: `_IOR('X', 125, __u32)`, the shutdown ioctl of xfstests'
/// `godown` and crash-test suites. Its argument points to the flags (0 default, 1 flush
/// the log, 2 do not).
pub const XFS_IOC_GOINGDOWN: u32 = 0x8004_587d;

/// chattr/lsattr's ioctls (`_IOR('f', 1, long)` and friends; the kernel passes their
/// argument as a 4-byte int) and xfs_io's FS_IOC_FSGETXATTR/FSSETXATTR (`struct fsxattr`,
/// 28 bytes, of which Patchwork keeps the flags word).
const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;
/// `FS_IOC_GETVERSION` (`_IOR('v', 1, long)`; ext4 stores an int): the inode's
/// generation, which `lsattr -v` shows and NFS file handles carry.
const FS_IOC_GETVERSION: u32 = 0x8008_7601;
/// Its 32-bit encoding (`_IOR('v', 1, int)`).
const FS_IOC32_GETVERSION: u32 = 0x8004_7601;
const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;
/// FS_XFLAG_IMMUTABLE, FS_XFLAG_APPEND, FS_XFLAG_NOATIME and their FS_*_FL.
const XFLAGS: [(u32, u32); 3] =
    [(0x8, pwfs::fs::FS_IMMUTABLE_FL), (0x10, pwfs::fs::FS_APPEND_FL), (0x40, pwfs::fs::FS_NOATIME_FL)];

fn xflags_of(flags: u32) -> u32 {
    XFLAGS.iter().filter(|(_, f)| flags & f != 0).map(|(x, _)| x).sum()
}

fn flags_of_xflags(x: u32) -> pwfs::Result<u32> {
    let known: u32 = XFLAGS.iter().map(|(x, _)| x).sum();
    if x & !known != 0 {
        return Err(pwfs::Error::new(pwfs::ErrorKind::NotSupported, "xflags Patchwork does not keep"));
    }
    Ok(XFLAGS.iter().filter(|(xf, _)| x & xf != 0).map(|(_, f)| f).sum())
}
/// Largest write the kernel sends in one request.
const MAX_WRITE: u32 = 1 << 20;

struct PwFuse {
    fs: Fs,
    cache: KernelCache,
    /// Ask for FUSE over io_uring at INIT (used when the kernel offers it).
    uring: bool,
    /// The kernel's lookup count per inode. While it is not zero the inode holds an
    /// engine handle (like an open file), so an unlinked inode is not freed and its
    /// number not reused before the kernel forgets it: FUSE node ids must stay unique
    /// until then.
    /// With each count, the generation of the inode counted: the kernel's node id is
    /// the inode number, and an entry for an inode freed and its number taken since
    /// must not reach the kernel as that number.
    lookups: std::sync::Mutex<std::collections::HashMap<u64, (u64, u32)>>,
    /// Sends invalidations to the kernel (set once the session exists).
    notifier: Arc<OnceLock<fuser::Notifier>>,
    /// What the kernel may hold of files changed behind its back (the shim's writes).
    view: Arc<KernelView>,
}

/// What the kernel may cache of each regular file (attributes, pages), for a mount
/// whose files also change behind the kernel's back (the LD_PRELOAD shim writes to
/// the engine directly): [`KernelView::changed`] then drops the kernel's copy, with
/// one invalidation, only if the kernel took something of that file since the last
/// one. A request that hands the kernel a file's attributes or pages marks the file
/// first (`touch`), before it reads the engine, so a change racing with it always
/// sees the mark: its invalidation then bumps the kernel's attribute version (a
/// reply to an older request is not cached) or waits for the page lock of a read in
/// progress. Inactive (no cost) when the mount has no shim.
pub struct KernelView {
    active: bool,
    shards: Box<[std::sync::Mutex<Shard>]>,
    /// Wakes `changed` calls waiting for an invalidation of their inode in flight.
    settled: std::sync::Condvar,
    /// Bumped when an invalidation found no inode in the kernel (an entry reply for it
    /// may be on its way with what the change made stale): `hand_out` re-checks.
    missed: std::sync::atomic::AtomicU64,
    notifier: Arc<OnceLock<fuser::Notifier>>,
}

#[derive(Default)]
struct Shard {
    /// Inodes the kernel may hold something of.
    cached: std::collections::HashSet<u64>,
    /// Inodes being invalidated now.
    inflight: std::collections::HashSet<u64>,
    /// Inodes marked again after an invalidation found none (`changed`): once only, so
    /// that an inode the kernel never made (an interrupted lookup) or has dropped
    /// does not stay marked for ever.
    remarked: std::collections::HashSet<u64>,
}

impl KernelView {
    fn new(active: bool, notifier: Arc<OnceLock<fuser::Notifier>>) -> KernelView {
        let shards = (0..64).map(|_| Default::default()).collect();
        KernelView {
            active,
            shards,
            settled: std::sync::Condvar::new(),
            missed: std::sync::atomic::AtomicU64::new(0),
            notifier,
        }
    }

    fn shard(&self, ino: u64) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[(ino % self.shards.len() as u64) as usize].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The kernel is about to receive attributes or pages of `ino`.
    fn touch(&self, ino: u64) {
        if self.active {
            self.shard(ino).cached.insert(ino);
        }
    }

    /// The kernel forgot `ino`.
    fn forget(&self, ino: u64) {
        if self.active {
            self.shard(ino).cached.remove(&ino);
        }
    }

    /// `ino` changed behind the kernel's back: drop what it holds of it (attributes
    /// and every cached page). Synchronous: when it returns, a stat or read through
    /// the kernel sees the change, also when another change's invalidation of the
    /// same inode was in flight (it is waited for). Must not be called from a FUSE
    /// request of `ino`.
    pub fn changed(&self, ino: u64) {
        let mut sh = self.shard(ino);
        while sh.inflight.contains(&ino) {
            sh = self.settled.wait(sh).unwrap_or_else(|e| e.into_inner());
        }
        if !sh.cached.remove(&ino) {
            return;
        }
        sh.inflight.insert(ino);
        drop(sh);
        let mut missed = false;
        if let Some(n) = self.notifier.get() {
            if n.inval_inode(INodeNo(ino), 0, 0).is_err() {
                // Not in the kernel (yet): a reply creating it may carry stale figures.
                self.missed.fetch_add(1, Ordering::SeqCst);
                missed = true;
            }
        }
        let mut sh = self.shard(ino);
        sh.inflight.remove(&ino);
        // The kernel may be about to make its inode from that reply: the next change
        // must invalidate again (once).
        if missed && sh.remarked.insert(ino) {
            sh.cached.insert(ino);
        } else {
            sh.remarked.remove(&ino);
        }
        drop(sh);
        self.settled.notify_all();
    }
}

impl PwFuse {
    /// Attributes of `m` for the kernel to keep: a regular file is marked first and
    /// read again, so that a change by the shim after the read that gave `m` is either
    /// in the answer or invalidates it.
    fn fresh(&self, m: Metadata) -> Metadata {
        if !self.view.active || !m.is_file() {
            return m;
        }
        self.view.touch(m.ino);
        self.fs.getattr(m.ino).unwrap_or(m)
    }

    /// The number of invalidations that found no inode so far (see `recheck`).
    fn missed(&self) -> u64 {
        self.view.missed.load(Ordering::SeqCst)
    }

    /// After an entry reply for `ino` (which may have created the kernel's inode): if an
    /// invalidation found no inode in the kernel since `before`, it may have been this
    /// one, changed between the reply's read and its arrival; drop it again now that
    /// the kernel has it. (After the reply: the kernel holds no lock of the request.
    /// Over FUSE over io_uring the answer reaches the kernel only when the handler has
    /// returned, so the first try comes too early and the retries below cover it.)
    fn recheck(&self, ino: u64, before: u64) {
        if self.view.active && self.missed() != before {
            if let Some(n) = self.notifier.get() {
                if n.inval_inode(INodeNo(ino), -1, 0).is_err() {
                    // The kernel makes its inode on the caller's thread once the reply
                    // wakes it, which may be after this: again from another thread
                    // until the kernel has it, for up to about a second (rare: only
                    // when a shim change raced this reply).
                    // At most a few at once (each waits up to a second).
                    static RETRYING: AtomicUsize = AtomicUsize::new(0);
                    if RETRYING.fetch_add(1, Ordering::AcqRel) >= 8 {
                        RETRYING.fetch_sub(1, Ordering::AcqRel);
                        return;
                    }
                    let n = n.clone();
                    std::thread::spawn(move || {
                        for ms in [1, 2, 5, 10, 20, 50, 100, 200, 600] {
                            std::thread::sleep(std::time::Duration::from_millis(ms));
                            if n.inval_inode(INodeNo(ino), -1, 0).is_ok() {
                                break;
                            }
                        }
                        RETRYING.fetch_sub(1, Ordering::AcqRel);
                    });
                }
            }
        }
    }

    /// Reply with an entry and count the kernel's new reference to it.
    fn entry(&self, reply: ReplyEntry, r: pwfs::Result<Metadata>) {
        self.entry_for(reply, r, &TTL)
    }

    /// `entry`, cached by the kernel for `ttl`.
    fn entry_for(&self, reply: ReplyEntry, r: pwfs::Result<Metadata>, ttl: &Duration) {
        match r {
            Ok(m) => {
                // Freed since its attributes were read (a FORGET racing a lookup by
                // handle): not handed to the kernel, whose node ids must stay unique.
                if !self.remember(&m) {
                    return reply.error(Errno::ENOENT);
                }
                let before = self.missed();
                let m = self.fresh(m);
                reply.entry(ttl, &attr(&m), generation(&m));
                self.recheck(m.ino, before);
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    /// fileattr_set_prepare's rule: the owner (or root) may set flags, and changing
    /// immutable or append-only takes CAP_LINUX_IMMUTABLE.
    fn may_set_flags(&self, req: &Request, ino: u64, flags: u32) -> Result<(), Errno> {
        let owner = self.fs.getattr(ino).map_err(errno)?.uid;
        // inode_owner_or_capable: the owner, or CAP_FOWNER (3).
        if req.uid() != 0 && req.uid() != owner && !capable_here(req.pid(), 3) {
            return Err(Errno::EPERM);
        }
        let guarded = pwfs::fs::FS_IMMUTABLE_FL | pwfs::fs::FS_APPEND_FL;
        let old = self.fs.get_flags(ino).map_err(errno)?;
        if (old ^ flags) & guarded != 0 && !linux_immutable(req.pid()) {
            return Err(Errno::EPERM);
        }
        Ok(())
    }

    /// Whether open handles are counted with the engine (`open_ino`/`release_ino`).
    /// Not in write-through mode: there the kernel opens without asking (no_open, see
    /// `open`), and once it does it sends no RELEASE for any handle, created ones
    /// included, so a count taken at create would never be given back (an unlinked
    /// file would then hold its space until unmount). The kernel's lookup reference,
    /// which every open file's inode holds and which `remember` counts, keeps the
    /// engine's inode alive instead, until the kernel forgets it.
    fn counts_handles(&self) -> bool {
        self.cache != KernelCache::WriteThrough
    }

    /// Answer a create or tmpfile: the kernel now holds a lookup reference to the new
    /// inode (`remember`), and a handle opened with `flags`; `uncount` gives back the
    /// open the engine counted for it, once the lookup reference holds the inode.
    fn created(&self, reply: ReplyCreate, made: pwfs::Result<Metadata>, flags: i32, uncount: bool) {
        match made {
            Ok(m) => {
                // The open counted for it holds the inode; without one (`uncount`
                // false) a racing unlink may have freed it.
                let held = self.remember(&m);
                if uncount {
                    self.fs.release_ino(m.ino);
                }
                if !held {
                    return reply.error(Errno::ENOENT);
                }
                let before = self.missed();
                let m = self.fresh(m);
                reply.created(&TTL, &attr(&m), generation(&m), handle_of(flags), self.open_flags(flags, true));
                self.recheck(m.ino, before);
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Count a new reference of the kernel's to the inode of `m` (an entry about to be
    /// sent); false, counting nothing, if that inode is gone (freed, or its number
    /// taken by a new file since `m` was read: its generation differs): the entry must
    /// not be sent.
    fn remember(&self, m: &Metadata) -> bool {
        let ino = m.ino;
        let mut l = self.lookups.lock().expect("lookup table");
        if let Some((n, generation)) = l.get_mut(&ino) {
            if *generation != m.generation {
                return false;
            }
            *n += 1;
            return true;
        }
        match self.fs.open_ino(ino) {
            Ok(now) if now.generation == m.generation => {
                l.insert(ino, (1, m.generation));
                true
            }
            Ok(_) => {
                drop(l);
                self.fs.release_ino(ino);
                false
            }
            Err(_) => false,
        }
    }

    /// After a shutdown: drop what the kernel caches (attributes, pages) of every inode
    /// it knows, so that reads it would have served itself come here and fail with EIO.
    /// On a thread of its own: an invalidation waits for the kernel's page locks, which
    /// a request in progress may hold. The caller waits for it (bounded) before it
    /// answers the shutdown, so that a read right after the ioctl returns is not
    /// served from the kernel's cache (it was, now and then, when the answer went
    /// first).
    fn forget_kernel_caches(&self) -> Option<std::sync::mpsc::Receiver<()>> {
        let n = self.notifier.get().cloned()?;
        let mut inos: Vec<u64> = self.lookups.lock().expect("lookup table").keys().copied().collect();
        inos.push(pwfs::format::ROOT_INO);
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for ino in inos {
                let _ = n.inval_inode(INodeNo(ino), 0, 0);
            }
            let _ = done.send(());
        });
        Some(finished)
    }

    /// Drop the kernel's pages (and attributes) of an inode, on another thread: the
    /// pages of a write being answered are locked until its answer.
    fn drop_kernel_pages(&self, ino: INodeNo) {
        if let Some(n) = self.notifier.get().cloned() {
            let _ = std::thread::Builder::new().name("pwfs-inval".into()).spawn(move || n.inval_inode(ino, 0, 0));
        }
    }

    /// The engine changed an inode's attributes without a request that makes the
    /// kernel drop its copy (an ioctl's new flags set ctime): drop them (offset -1:
    /// not its pages).
    fn attrs_changed(&self, ino: INodeNo) {
        if let Some(n) = self.notifier.get() {
            let _ = n.inval_inode(ino, -1, 0);
        }
    }

    fn forget_n(&self, ino: u64, n: u64) {
        let last = {
            let mut l = self.lookups.lock().expect("lookup table");
            match l.get_mut(&ino) {
                Some((c, _)) => {
                    // The kernel forgets what it was given: more is a counting bug here
                    // (an inode freed while the kernel still holds it), worth a line.
                    if n > *c {
                        say!("pwfs: the kernel forgot {n} references to inode {ino}, which had {c}");
                    }
                    *c = c.saturating_sub(n);
                    let last = *c == 0;
                    if last {
                        l.remove(&ino);
                        self.view.forget(ino);
                    }
                    last
                }
                None => {
                    if ino != pwfs::format::ROOT_INO {
                        say!("pwfs: the kernel forgot {n} references to inode {ino}, which had none");
                    }
                    false
                }
            }
        };
        // After the table's lock: releasing the last hold of an unlinked inode frees
        // it, which can wait for a commit, and every entry reply needs the table.
        if last {
            self.fs.release_ino(ino);
        }
    }
}

/// The handle a file is opened with: `WRITABLE` for an open that may write (a lost
/// write is reported by the close of such a handle only, as `File::close` does), 0
/// otherwise. Nothing else is kept per handle.
fn handle_of(flags: i32) -> FileHandle {
    match flags & libc::O_ACCMODE {
        libc::O_WRONLY | libc::O_RDWR => WRITABLE,
        // O_RDONLY, and 3 (ioctl only).
        _ => FileHandle(0),
    }
}

const WRITABLE: FileHandle = FileHandle(1);

/// The generation an entry reply carries: the root's is 0, as the kernel expects of
/// node 1 (it warns and forces 0 otherwise; mkfs gives the root generation 1 on disk).
fn generation(m: &Metadata) -> Generation {
    Generation(if m.ino == pwfs::format::ROOT_INO { 0 } else { m.generation as u64 })
}

fn errno(e: pwfs::Error) -> Errno {
    Errno::from_i32(e.errno())
}

/// A stored time as the kernel gets it. Total: any `i64` second a user set (utimensat
/// takes them all on a FUSE mount) converts without overflow; a platform whose
/// `SystemTime` holds less gets the farthest time it holds on that side.
fn time(t: Timespec) -> SystemTime {
    let secs = Duration::from_secs(t.sec.unsigned_abs());
    let whole = if t.sec >= 0 { UNIX_EPOCH.checked_add(secs) } else { UNIX_EPOCH.checked_sub(secs) };
    let whole = whole.unwrap_or_else(|| far(UNIX_EPOCH, t.sec >= 0));
    let nsec = Duration::from_nanos(u64::from(t.nsec.min(999_999_999)));
    whole.checked_add(nsec).unwrap_or(whole)
}

/// The latest (or earliest) time `SystemTime` holds from `from`, to within a second.
fn far(from: SystemTime, later: bool) -> SystemTime {
    let (mut t, mut step) = (from, Duration::from_secs(1 << 62));
    while step >= Duration::from_secs(1) {
        let next = if later { t.checked_add(step) } else { t.checked_sub(step) };
        match next {
            Some(n) => t = n,
            None => step /= 2,
        }
    }
    t
}

/// A time from a request, as the engine stores it (seconds and nanoseconds, the
/// nanoseconds counted forward as a timespec's are). Saturates at the ends of `i64`.
fn timespec(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => match i64::try_from(d.as_secs()) {
            Ok(sec) => Timespec { sec, nsec: d.subsec_nanos() },
            Err(_) => Timespec { sec: i64::MAX, nsec: 999_999_999 },
        },
        Err(e) => {
            let d = e.duration();
            let nsec = d.subsec_nanos();
            // Seconds before the epoch, rounded up when there are nanoseconds: those
            // then count forward from it.
            let back = d.as_secs().saturating_add(u64::from(nsec > 0));
            match 0i64.checked_sub_unsigned(back) {
                Some(sec) => Timespec { sec, nsec: if nsec > 0 { 1_000_000_000 - nsec } else { 0 } },
                None => Timespec { sec: i64::MIN, nsec: 0 },
            }
        }
    }
}

fn kind(k: pwfs::FileType) -> FileType {
    match k {
        pwfs::FileType::File => FileType::RegularFile,
        pwfs::FileType::Directory => FileType::Directory,
        pwfs::FileType::Symlink => FileType::Symlink,
        pwfs::FileType::Fifo => FileType::NamedPipe,
        pwfs::FileType::CharDevice => FileType::CharDevice,
        pwfs::FileType::BlockDevice => FileType::BlockDevice,
        pwfs::FileType::Socket => FileType::Socket,
    }
}

fn attr(m: &Metadata) -> FileAttr {
    FileAttr {
        ino: INodeNo(m.ino),
        size: m.size,
        blocks: m.blocks,
        atime: time(m.atime),
        mtime: time(m.mtime),
        ctime: time(m.ctime),
        crtime: time(m.ctime),
        kind: kind(m.kind),
        perm: (m.mode & 0o7777) as u16,
        nlink: m.nlink,
        uid: m.uid,
        gid: m.gid,
        rdev: m.rdev,
        blksize: m.blksize,
        flags: 0,
    }
}

/// The creator of a new inode of `mode`, asking with `umask` (FUSE_DONT_MASK: the
/// engine applies it, unless the directory has a default ACL). The kernel has already
/// stripped S_ISGID where its creator may not have it (`mode_strip_sgid`); the engine
/// applies the same rule, for which a file asking for S_ISGID needs the creator's
/// supplementary groups and CAP_FSETID: read from /proc then only (rare).
fn creator(req: &Request, mode: u32, umask: u32) -> Creator {
    let mut who = Creator { umask, ..Creator::new(req.uid(), req.gid()) };
    if mode & libc::S_ISGID != 0 && mode & libc::S_IFMT != libc::S_IFDIR {
        let (groups, fsetid) = groups_and_fsetid(req.pid());
        (who.groups, who.fsetid) = (groups, fsetid);
    }
    who
}

/// Supplementary groups and whether CAP_FSETID is effective, of process `pid`
/// (/proc/PID/status `Groups:` and `CapEff:`); none when it cannot be read.
fn groups_and_fsetid(pid: u32) -> (Vec<u32>, bool) {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return (Vec::new(), false);
    };
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let groups = field("Groups:").map(|g| g.split_whitespace().filter_map(|n| n.parse().ok()).collect());
    let caps = field("CapEff:").and_then(|c| u64::from_str_radix(c, 16).ok()).unwrap_or(0);
    const CAP_FSETID: u64 = 4;
    (groups.unwrap_or_default(), caps & (1 << CAP_FSETID) != 0)
}

/// Whether `req`'s caller is in group `gid` (its own, or a supplementary one from
/// /proc; none when that cannot be read).
fn member(req: &Request, gid: u32) -> bool {
    req.gid() == gid || groups_and_fsetid(req.pid()).0.contains(&gid)
}

/// Whether process `pid` has CAP_FSETID (4) as the kernel's `capable()` asks.
fn fsetid_here(pid: u32) -> bool {
    capable_here(pid, 4)
}

/// Whether process `pid` has capability `cap` as the kernel's `capable()` asks: in
/// effect, and in the user namespace of this daemon (`unshare -r`'s root has none
/// over a daemon started outside it). Compared with our own namespace, not init's:
/// /proc/1/ns may not be readable (EACCES where PID 1 is not dumpable), and a daemon
/// runs in the initial namespace unless it was started in another one.
fn capable_here(pid: u32, cap: u32) -> bool {
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/user")).ok();
    let same = matches!((ns(&pid.to_string()), ns("self")), (Some(a), Some(b)) if a == b);
    same && has_cap(pid, cap)
}

/// Whether process `pid` has capability number `cap` in effect (/proc/PID/status).
fn has_cap(pid: u32, cap: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return false };
    let caps = status.lines().find_map(|l| l.strip_prefix("CapEff:")).map(str::trim);
    caps.and_then(|c| u64::from_str_radix(c, 16).ok()).is_some_and(|c| c & (1 << cap) != 0)
}

/// CAP_LINUX_IMMUTABLE (9).
fn linux_immutable(pid: u32) -> bool {
    has_cap(pid, 9)
}

fn empty(reply: ReplyEmpty, r: pwfs::Result<()>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

fn time_set(t: TimeOrNow) -> TimeSet {
    match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => TimeSet::At(timespec(t)),
    }
}

/// getxattr/listxattr: size 0 asks for the length; too small a buffer is ERANGE.
fn xattr_reply(reply: ReplyXattr, data: &[u8], size: u32) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if (size as usize) < data.len() {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(data);
    }
}

impl PwFuse {
    /// Open flags for a data file opened with `flags` (open(2)'s); `created`: by this
    /// open (O_CREAT of a new file).
    fn open_flags(&self, flags: i32, created: bool) -> FopenFlags {
        let read_only = flags & libc::O_ACCMODE == libc::O_RDONLY;
        // No flush request at close(2) of a handle that cannot write, or that created
        // its file (an untar, a compiler's output: one request fewer per file). Such a
        // handle's writes start on an empty file, with no old data to read; should a
        // later one still lose its page read, fsync reports it, as ext4 reports
        // write-back errors. With direct I/O other write handles keep the flush: close
        // reports a non-blocking write lost after it returned. (The cached modes send
        // no flush at all: see `flush`.)
        let noflush = if read_only || created { FopenFlags::FOPEN_NOFLUSH } else { FopenFlags::empty() };
        match self.cache {
            KernelCache::Off => FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES | noflush,
            KernelCache::WriteThrough | KernelCache::WriteBack => FopenFlags::FOPEN_KEEP_CACHE | noflush,
        }
    }

    /// `Fs::kill_privs` for a change the kernel no longer clears privileges for itself
    /// (FUSE_HANDLE_KILLPRIV_V2, with fuser passing on no FATTR_KILL_SUIDGID): whether
    /// the caller lacks CAP_FSETID is read from /proc, only when the file has a set-ID
    /// bit.
    fn kill_privs(&self, req: &Request, ino: u64, change: PrivChange) -> pwfs::Result<bool> {
        let setid = self.fs.getattr(ino)?.mode & (libc::S_ISUID | libc::S_ISGID) != 0 && !fsetid_here(req.pid());
        let in_group = |gid| member(req, gid);
        self.fs.kill_privs(ino, setid.then_some(&in_group as &dyn Fn(u32) -> bool), change)
    }

    /// Whether a chown(2) by `req`'s caller of `ino` (of `m`) clears an S_ISGID that
    /// has no group execute: it is neither in the file's group nor holds CAP_FSETID
    /// (`perm::setid_to_clear`); /proc is read for such a file only.
    fn chown_outsider(&self, req: &Request, m: &pwfs::Metadata) -> bool {
        pwfs::fs::perm::sgid_asks_group(m.mode) && !fsetid_here(req.pid()) && !member(req, m.gid)
    }
}

impl Filesystem for PwFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.add_capabilities(
            InitFlags::FUSE_PARALLEL_DIROPS
                | InitFlags::FUSE_ASYNC_DIO
                | InitFlags::FUSE_BIG_WRITES
                | InitFlags::FUSE_DO_READDIRPLUS
                | InitFlags::FUSE_READDIRPLUS_AUTO
                | InitFlags::FUSE_CACHE_SYMLINKS
                // File handles survive a remount: inode numbers and generations are
                // on disk (name_to_handle_at, open_by_handle_at, NFS export).
                | InitFlags::FUSE_EXPORT_SUPPORT
                // The kernel checks POSIX ACLs (read from here with getxattr), and
                // leaves the umask to us: a new inode under a default ACL ignores it.
                | InitFlags::FUSE_POSIX_ACL
                | InitFlags::FUSE_DONT_MASK,
        );
        // The server clears set-ID bits and file capabilities on writes, truncates and
        // chowns; the kernel then marks the file system SB_NOSEC and stops asking for
        // security.capability (a GETXATTR request) before every cached write.
        let _ = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
        if self.cache != KernelCache::Off {
            let _ = config.add_capabilities(InitFlags::FUSE_NO_OPENDIR_SUPPORT);
        }
        if self.cache == KernelCache::WriteBack {
            let _ = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE);
        }
        // Requests through per-CPU io_uring entries instead of /dev/fuse reads, where
        // the kernel offers it (the vendored fuser serves them, vendor/fuser/PATCHWORK.md).
        if self.uring {
            let _ = config.add_capabilities(InitFlags::FUSE_OVER_IO_URING);
        }
        Ok(())
    }

    fn destroy(&mut self) {
        // The kernel sends no forgets at unmount: drop its references here, so that
        // files unlinked while it held them are freed by the final sync.
        let held: Vec<(u64, (u64, u32))> = self.lookups.lock().expect("lookup table").drain().collect();
        for (ino, _) in held {
            self.fs.release_ino(ino);
        }
        // Unmount: everything durable, the journal empty (a file system shut down
        // writes nothing more).
        if self.fs.is_down() {
            return;
        }
        if let Err(e) = self.fs.sync() {
            say!("pwfs: sync at unmount failed: {e}");
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.forget_n(ino.0, nlookup);
    }

    /// Also "." of any inode and ".." of a directory: the kernel looks them up to turn
    /// a file handle (open_by_handle_at, NFS export) back into an inode it no longer
    /// holds, and checks the generation it gets against the handle's (ESTALE).
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match name.as_bytes() {
            // A file with no name left is stale to a handle, as on ext4: the kernel
            // let go of it, so it waits only to be freed (its pages may be gone).
            b"." => match self.fs.getattr(parent.0) {
                Ok(m) if m.nlink == 0 => reply.error(Errno::ESTALE),
                r => self.entry(reply, r),
            },
            name => self.entry(reply, self.fs.lookup(parent.0, name)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.view.touch(ino.0);
        match self.fs.getattr(ino.0) {
            Ok(m) => reply.attr(&TTL, &attr(&m)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // chown(2) to no new owner or group (-1, -1) comes as a request that changes
        // nothing but, with the kernel's write-back cache, ctime (the kernel leaves the
        // set-ID bits to us): it clears set-ID bits and capabilities and sets ctime, as
        // any chown.
        let same_owner = (mode, uid, gid, size) == (None, None, None, None) && atime.is_none() && mtime.is_none();
        let chown = uid.is_some() || gid.is_some() || same_owner;
        let outsider = match chown {
            true => match self.fs.getattr(ino.0) {
                Ok(m) => self.chown_outsider(req, &m),
                Err(e) => return reply.error(errno(e)),
            },
            false => false,
        };
        // With the write-back cache the kernel keeps mtime and ctime itself and sends
        // its "now" as a time: an mtime equal to the ctime it sends along is its touch
        // or its own update, not a time a caller chose (which an append-only file
        // refuses).
        let mtime = match (mtime, ctime) {
            (Some(TimeOrNow::SpecificTime(t)), Some(c)) if t == c => Some(TimeSet::Current(timespec(t))),
            (m, _) => m.map(time_set),
        };
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time_set),
            mtime,
            ctime: ctime.map(timespec),
            kill_setid: same_owner,
            outsider,
        };
        self.view.touch(ino.0);
        // FUSE_HANDLE_KILLPRIV_V2: a truncate clears the set-ID bits of a caller
        // without CAP_FSETID (the kernel's FATTR_KILL_SUIDGID, which fuser does not pass
        // on: the caller's capability is read from /proc, only when such a bit is set)
        // and anyone's file capabilities; a change of owner drops the capabilities too
        // (the engine clears set-ID bits on it already).
        let killed = match (size, chown) {
            (Some(_), _) => self.kill_privs(req, ino.0, PrivChange::Attributes),
            (None, true) => self.fs.kill_privs(ino.0, None, PrivChange::Attributes),
            (None, false) => Ok(false),
        };
        if let Err(e) = killed {
            return reply.error(errno(e));
        }
        match self.fs.setattr(ino.0, &set) {
            Ok(m) => reply.attr(&TTL, &attr(&m)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.fs.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        self.entry(reply, self.fs.mknod(parent.0, name.as_bytes(), mode, rdev, &creator(req, mode, umask)))
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        self.entry(reply, self.fs.mkdir(parent.0, name.as_bytes(), mode, &creator(req, libc::S_IFDIR, umask)))
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.fs.unlink(parent.0, name.as_bytes()))
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.fs.rmdir(parent.0, name.as_bytes()))
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        self.entry(
            reply,
            self.fs.symlink(parent.0, link_name.as_bytes(), target.as_os_str().as_bytes(), &creator(req, 0, 0)),
        )
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let known = RenameFlags::RENAME_NOREPLACE | RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT;
        let exchange = flags.contains(RenameFlags::RENAME_EXCHANGE);
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let whiteout = flags.contains(RenameFlags::RENAME_WHITEOUT);
        // The kernel refuses these combinations itself; a request that has one anyway is
        // refused as renameat2(2) would.
        if !(flags - known).is_empty() || (exchange && (noreplace || whiteout)) {
            return reply.error(Errno::EINVAL);
        }
        let (sp, sname, dp, dname) = (parent.0, name.as_bytes(), newparent.0, newname.as_bytes());
        let r = if exchange {
            self.fs.rename_exchange(sp, sname, dp, dname)
        } else if whiteout {
            self.fs.rename_whiteout(sp, sname, dp, dname, noreplace, (req.uid(), req.gid()))
        } else {
            self.fs.rename(sp, sname, dp, dname, noreplace)
        };
        empty(reply, r)
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        // The kernel applies a link reply's attributes to the inode it holds without
        // checking their version: a shim change racing this reply would stay hidden for
        // the attribute timeout. With a shim, the reply is not cached (the next stat
        // asks again; link is rare).
        let ttl = if self.view.active { Duration::ZERO } else { TTL };
        self.entry_for(reply, self.fs.link(ino.0, newparent.0, newname.as_bytes()), &ttl)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // In write-through mode (the default), no open and release requests at all (the
        // kernel's no_open, as FUSE_NO_OPEN_SUPPORT): it then opens files with
        // FOPEN_KEEP_CACHE, which is what they get here anyway, and sends no RELEASE. An
        // open file stays alive after its last unlink all the same: the kernel holds a
        // lookup reference to its inode while any file is open on it, and each lookup
        // reference holds the engine's inode (`remember`) until the kernel forgets it.
        // What is lost: an open for writing of an immutable or append-only file is
        // refused at its first write (EPERM, which reaches the writer in this mode)
        // rather than at open. In write-back mode a refused write would surface only at
        // write-back, so opens are still checked there; with direct I/O each open needs
        // its FOPEN_DIRECT_IO. webproxy-like (open, read, close of small files): see
        // docs/BENCHMARKS.md.
        if self.cache == KernelCache::WriteThrough {
            return reply.error(Errno::ENOSYS);
        }
        // O_TRUNC never arrives here: without FUSE_ATOMIC_O_TRUNC the kernel checks write
        // access (ETXTBSY) first and then truncates with a setattr.
        // may_open's rule for chattr flags, which the kernel does not know here: no
        // write access to an immutable file, and to an append-only one only with O_APPEND.
        let mut open_flags = self.open_flags(flags.0, false);
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            match self.fs.get_flags(ino.0) {
                Ok(f) if f & pwfs::fs::FS_IMMUTABLE_FL != 0 => return reply.error(Errno::EPERM),
                Ok(f) if f & pwfs::fs::FS_APPEND_FL != 0 && flags.0 & libc::O_APPEND == 0 => {
                    return reply.error(Errno::EPERM)
                }
                // The kernel's write-back cache would send an append as a write of its
                // whole page (below the end of the file), which an append-only file
                // refuses: such files are written through, as they are made.
                Ok(f) if f & pwfs::fs::FS_APPEND_FL != 0 => open_flags |= FopenFlags::FOPEN_DIRECT_IO,
                Ok(_) => {}
                Err(e) => return reply.error(errno(e)),
            }
        }
        match self.fs.open_ino(ino.0) {
            Ok(_) => reply.opened(handle_of(flags.0), open_flags),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        // Answered straight from the engine's cache (the reply's iovecs point at its
        // pages): a copy into a buffer of ours cost as much CPU as the kernel's copy
        // of the reply into its page cache (a cold sequential read). The iovecs: the
        // header and a slice per page of the largest read (the kernel sends none over
        // MAX_WRITE), which writev takes up to UIO_MAXIOV.
        const _: () = assert!(MAX_WRITE as usize / 4096 + 2 <= 1024);
        self.view.touch(ino.0);
        let mut reply = Some(reply);
        // Whether the kernel keeps what this read gets (drop-behind, `Fs::read_with`):
        // not through a descriptor opened O_DIRECT, nor in direct-I/O mode, nor (to be
        // safe) through an appending handle in write-back mode, which an append-only
        // file's open makes direct I/O.
        let f = flags.0;
        let kept = self.cache != KernelCache::Off
            && f & libc::O_DIRECT == 0
            && !(self.cache == KernelCache::WriteBack && f & libc::O_APPEND != 0);
        let sent = self.fs.read_with(ino.0, offset, size as usize, kept, |iov| {
            if let Some(r) = reply.take() {
                r.data_vectored(iov);
            }
        });
        if let (Err(e), Some(r)) = (sent, reply) {
            r.error(errno(e));
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        // Set-ID bits (when the writer lacks CAP_FSETID, which the kernel says on
        // every write: FUSE_HANDLE_KILLPRIV_V2, and direct writes always) and file
        // capabilities go first (an atomic load when there is nothing to drop).
        let change = match write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) {
            true => PrivChange::CachedWrite,
            false => PrivChange::Write,
        };
        // An append-only file takes writes only from O_APPEND descriptors: the open
        // that ext4 refuses was not sent here (write-through mode has no open requests).
        // The kernel's own write-back of cached pages carries no descriptor's flags.
        // Before anything is cleared: a refused write changes nothing.
        if !write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) {
            if let Err(e) = self.fs.check_fd_write(ino.0, flags.0 & libc::O_APPEND != 0) {
                return reply.error(errno(e));
            }
        }
        let in_group = |gid| member(req, gid);
        let setid = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        match self.fs.kill_privs(ino.0, setid.then_some(&in_group as &dyn Fn(u32) -> bool), change) {
            // The kernel keeps the mode it had cached after a write: drop its
            // attributes (offset -1: not its pages, which this write may hold).
            Ok(true) => {
                if let Some(n) = self.notifier.get() {
                    let _ = n.inval_inode(ino, -1, 0);
                }
            }
            Ok(false) => {}
            Err(e) => return reply.error(errno(e)),
        }
        // O_APPEND is resolved by the kernel into the offset it sends, from the size it
        // caches; after the shim appended (behind its back) that size can be stale, and
        // the kernel does not ask again before an append. The engine appends at its own
        // end instead, and if that is not where the kernel put the data in its pages,
        // the kernel's copy is dropped (on another thread: this write's pages are
        // locked until it is answered).
        self.view.touch(ino.0);
        // (The write-back cache sends whole pages at their place and asks for the size
        // itself before an append.)
        let append = self.view.active && self.cache != KernelCache::WriteBack && flags.0 & libc::O_APPEND != 0;
        // O_SYNC / O_DSYNC: durable before the reply (a direct write gets no FSYNC
        // request from the kernel after it; a cached one does, and finds nothing left).
        let sync = match (flags.0 & libc::O_SYNC == libc::O_SYNC, flags.0 & libc::O_DSYNC != 0) {
            (true, _) => Some(false),
            (false, true) => Some(true),
            _ => None,
        };
        let cached = write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        let mut written = self.fs.write(ino.0, offset, data, append);
        // A page the kernel writes back from its cache is acknowledged data: the kernel
        // keeps only an error for it (a short count would leave the rest marked clean
        // and unreported). The rest is tried again, for its error.
        if let (true, Ok((at, n))) = (cached, &written) {
            let (at, n) = (*at, *n);
            if n < data.len() {
                written = match self.fs.write(ino.0, at + n as u64, &data[n..], false) {
                    Ok((_, m)) if n + m == data.len() => Ok((at, data.len())),
                    Ok(_) => Err(pwfs::Error::io("a page written back by the kernel was written short")),
                    Err(e) => Err(e),
                };
            }
        }
        let written = match (written, sync) {
            (Ok(at), Some(datasync)) => self.fs.fsync(ino.0, datasync).map(|()| at),
            (r, _) => r,
        };
        match written {
            Ok((at, n)) => {
                reply.written(n as u32);
                if at != offset {
                    self.drop_kernel_pages(ino);
                }
            }
            Err(e) => {
                // A page the kernel wrote back from its cache (a shared mapping's
                // stores) is data a program was told it wrote: the kernel keeps this
                // errno for the file's next fsync, which returns it without asking
                // here. On a file system turned read-only by an error that is EIO (as
                // every fsync here answers then), not EROFS, which programs take for
                // "cannot sync" and go on.
                let code = match (cached, e.kind()) {
                    (true, pwfs::ErrorKind::ReadOnly) if self.fs.poisoned().is_some() => Errno::EIO,
                    _ => errno(e.clone()),
                };
                reply.error(code);
                if cached {
                    say!(
                        "pwfs: inode {}: {} bytes at {offset} written back by the kernel were refused: {e}",
                        ino.0,
                        data.len()
                    );
                    // The kernel's copy is not the file's, and must not be read as it.
                    self.drop_kernel_pages(ino);
                }
            }
        }
    }

    /// close(2) of a handle. With direct I/O (`Off`) it reports a write to this file
    /// that was lost after it returned (a non-blocking write whose page then could not
    /// be read); it waits for no I/O.
    ///
    /// In the cached modes it answers ENOSYS, once: the kernel then never sends a flush
    /// again on this mount (`fc->no_flush`; since Linux 5.14 it still writes back its
    /// own dirty pages at close and reports their errors first). Write-through opens
    /// files without an open request (`open`), and write-back's kernel ignores
    /// `FOPEN_NOFLUSH`, so neither can be told per handle that a close needs no flush:
    /// every close(2) of any file — a read-only one too — was a round trip, half of
    /// the requests of a webproxy-like loop. A lost non-blocking write is then reported
    /// by the next fsync or fdatasync of the file, as ext4 reports a write-back error
    /// (and ext4's close reports nothing), and logged. See docs/DECISIONS.md.
    fn flush(&self, req: &Request, ino: INodeNo, fh: FileHandle, _lock_owner: fuser::LockOwner, reply: ReplyEmpty) {
        if self.cache != KernelCache::Off {
            return reply.error(Errno::ENOSYS);
        }
        // A reader's close does not take the report: the writer's fsync or close
        // would then say nothing (`handle_of`).
        if fh != WRITABLE {
            return reply.ok();
        }
        // This process's own closes (the shim's daemon side drops the descriptor a
        // client registered) report nothing: the report is the client's, at its close.
        // The request names a thread: the shim's session threads are named so.
        let shim_thread =
            || std::fs::read(format!("/proc/self/task/{}/comm", req.pid())).is_ok_and(|c| c.starts_with(b"pwfs-shim"));
        if req.pid() == std::process::id() || shim_thread() {
            return reply.ok();
        }
        empty(reply, self.fs.flush(ino.0))
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Handles are not counted in write-through mode (`counts_handles`).
        if self.counts_handles() {
            self.fs.release_ino(ino.0);
        }
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.fs.fsync(ino.0, datasync))
    }

    /// fallocate(2). The kernel passes modes 0, KEEP_SIZE, PUNCH_HOLE and ZERO_RANGE
    /// (it refuses collapse and insert range on FUSE itself, with EOPNOTSUPP), drops its
    /// cached pages of a punched or zeroed range, and refreshes the size.
    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        // The kernel's `file_modified` no longer clears privileges (V2): here, once
        // the call is known to go ahead (a refused one keeps the bits, as on ext4).
        if let Err(e) = self.fs.fallocate_check(ino.0, mode as u32, offset, length) {
            return reply.error(errno(e));
        }
        if let Err(e) = self.kill_privs(req, ino.0, PrivChange::Write) {
            return reply.error(errno(e));
        }
        empty(reply, self.fs.fallocate(ino.0, mode as u32, offset, length))
    }

    /// copy_file_range(2) between files of this mount: the engine copies. (Without it the
    /// kernel copies through its page cache, and takes the end of the source from the
    /// size it caches, which a change through the LD_PRELOAD shim makes stale: a copy
    /// would stop at the old end.) The kernel has written back its dirty pages of both
    /// ranges before asking (privileges of the destination are cleared here: V2), and
    /// drops its pages of the destination range and its size after the answer.
    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: fuser::CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        // The answer is a 32-bit count: a longer copy is answered short, as the kernel
        // allows, and the caller asks again.
        let len = len.min(u64::from(u32::MAX) & !(MAX_WRITE as u64 - 1));
        // The kernel keeps both ranges within i64 (`generic_copy_file_checks`); past
        // that the engine would answer EFBIG, and the sums below must not overflow.
        if offset_in.checked_add(len).is_none() || offset_out.checked_add(len).is_none() {
            return reply.error(Errno::EFBIG);
        }
        self.view.touch(ino_out.0);
        // The kernel refuses an O_APPEND destination (EBADF); any other descriptor of an
        // append-only file could not have been opened for writing on ext4.
        if let Err(e) = self.fs.check_fd_write(ino_out.0, false) {
            return reply.error(errno(e));
        }
        if let Err(e) = self.kill_privs(req, ino_out.0, PrivChange::Write) {
            return reply.error(errno(e));
        }
        let mut buf = vec![0u8; len.min(MAX_WRITE as u64) as usize];
        let mut done = 0u64;
        while done < len {
            let want = ((len - done) as usize).min(buf.len());
            // A short write (no space for more, the largest file size) ends the copy
            // short, as a short read does.
            let step = self.fs.read(ino_in.0, offset_in + done, &mut buf[..want]).and_then(|n| {
                let (_, w) = self.fs.write(ino_out.0, offset_out + done, &buf[..n], false)?;
                Ok(w)
            });
            match step {
                Ok(n) => {
                    done += n as u64;
                    if n < want {
                        break;
                    }
                }
                Err(e) if done == 0 => return reply.error(errno(e)),
                Err(_) => break,
            }
        }
        reply.written(done as u32)
    }

    /// lseek(2): the kernel answers SEEK_SET/CUR/END itself and asks for SEEK_DATA and
    /// SEEK_HOLE. When the kernel caches data, it does not write back its dirty pages
    /// before it asks (a shared mapping's stores in write-through mode, every buffered
    /// write in write-back mode), so the engine would call data a hole and `cp` would
    /// copy zeros: then ENOSYS, and the kernel answers from the size alone from now on
    /// (the whole file is data), as for any file system without SEEK_DATA.
    fn lseek(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        if self.cache != KernelCache::Off {
            return reply.error(Errno::ENOSYS);
        }
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(Errno::ENXIO);
        };
        match whence {
            libc::SEEK_DATA | libc::SEEK_HOLE => {
                match self.fs.seek_hole_data(ino.0, offset, whence == libc::SEEK_HOLE) {
                    Ok(at) => reply.offset(at as i64),
                    Err(e) => reply.error(errno(e)),
                }
            }
            _ => reply.error(Errno::EINVAL),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.getattr(ino.0) {
            // No open or release request per directory from now on (FUSE_NO_OPENDIR_SUPPORT):
            // the kernel then keeps what readdir returned (FOPEN_CACHE_DIR and
            // FOPEN_KEEP_CACHE are its defaults without opendir), and drops it when it
            // changes the directory itself. A warm `find` of 821 directories made 1,642
            // requests fewer.
            Ok(m) if m.is_dir() && self.cache != KernelCache::Off => reply.error(Errno::ENOSYS),
            Ok(m) if m.is_dir() => reply.opened(FileHandle(0), FopenFlags::empty()),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        match self.fs.readdir(ino.0, offset, 512) {
            Ok(entries) => {
                for e in entries {
                    if reply.add(INodeNo(e.ino), e.next, kind(e.kind), OsStr::from_bytes(&e.name)) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Entries with their attributes (the kernel asks for this instead of `readdir`
    /// when it expects lookups of the entries to follow, as `ls -l` and `find` do).
    /// Each entry but "." and ".." is a lookup the kernel will forget.
    fn readdirplus(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        let before = self.missed();
        let mut handed = Vec::new();
        match self.fs.readdir(ino.0, offset, 256) {
            Ok(entries) => {
                for e in entries {
                    // By name, not by the listed number: an entry removed since the
                    // directory was read is left out, and one whose number went to
                    // another file meanwhile is not given that file's attributes.
                    let Ok(md) = self.fs.lookup(ino.0, &e.name) else { continue };
                    let dot = e.name == b"." || e.name == b"..";
                    // Counted before it is handed over; one freed meanwhile is left
                    // out, as one removed is.
                    if !dot && !self.remember(&md) {
                        continue;
                    }
                    let md = self.fresh(md);
                    let full = reply.add(
                        INodeNo(md.ino),
                        e.next,
                        OsStr::from_bytes(&e.name),
                        &TTL,
                        &attr(&md),
                        generation(&md),
                    );
                    if full {
                        if !dot {
                            self.forget_n(md.ino, 1);
                        }
                        break;
                    }
                    handed.push(md.ino);
                }
                reply.ok();
                for ino in handed {
                    self.recheck(ino, before);
                }
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.fs.fsync(ino.0, datasync))
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let (create, replace) = (flags & libc::XATTR_CREATE != 0, flags & libc::XATTR_REPLACE != 0);
        // An access ACL rewrites the mode; set by someone outside the file's group
        // without CAP_FSETID it clears set-group-ID too, as ext4 does. The kernel says
        // so only with FUSE_SETXATTR_EXT, which fuser does not parse: asked here, as
        // for chown.
        let drop_sgid = name.as_bytes() == b"system.posix_acl_access"
            && self
                .fs
                .getattr(ino.0)
                .is_ok_and(|m| m.mode & libc::S_ISGID != 0 && !fsetid_here(req.pid()) && !member(req, m.gid));
        empty(reply, self.fs.setxattr_as(ino.0, name.as_bytes(), value, create, replace, drop_sgid))
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.fs.getxattr(ino.0, name.as_bytes()) {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.fs.listxattr(ino.0) {
            Ok(mut names) => {
                // trusted.* names are listed to CAP_SYS_ADMIN only, as ext4 lists them
                // (the kernel leaves the list to the file system).
                const CAP_SYS_ADMIN: u32 = 21;
                if names.iter().any(|n| n.starts_with(b"trusted.")) && !capable_here(req.pid(), CAP_SYS_ADMIN) {
                    names.retain(|n| !n.starts_with(b"trusted."));
                }
                let mut list = Vec::new();
                for n in names {
                    list.extend_from_slice(&n);
                    list.push(0);
                }
                xattr_reply(reply, &list, size)
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        // A removexattr of file capabilities on an append-only file is let through:
        // the kernel sends its own for an append (`cap_inode_killpriv`, which ext4
        // allows there), and it cannot be told from a caller's (which ext4 refuses:
        // the FUSE inode carries no append-only flag for the kernel to check).
        match name.as_bytes() == b"security.capability" {
            true => empty(reply, self.fs.drop_caps(ino.0)),
            false => empty(reply, self.fs.removexattr(ino.0, name.as_bytes())),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        if self.fs.is_down() {
            return reply.error(Errno::EIO);
        }
        let s = self.fs.statfs();
        reply.statfs(
            s.blocks,
            s.blocks_free,
            s.blocks_available,
            s.inodes,
            s.inodes_free,
            s.block_size,
            s.name_max,
            s.block_size,
        );
    }

    /// Only `XFS_IOC_GOINGDOWN` (on any file or directory of the mount; root only, as
    /// XFS wants CAP_SYS_ADMIN). The kernel passes a FUSE server "restricted" ioctls
    /// only: it copies arguments by the size and direction encoded in the command, and
    /// this one is `_IOR` although XFS reads the flags *from* the caller, so the flags
    /// never arrive in the request. They are read from the caller's memory instead: the
    /// caller sits in ioctl(2) until this returns, so /proc/TID/syscall names the
    /// argument's address, and process_vm_readv reads it.
    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        match cmd {
            FS_IOC_GETFLAGS => {
                return match self.fs.get_flags(ino.0) {
                    Ok(f) => reply.ioctl(0, &f.to_ne_bytes()),
                    Err(e) => reply.error(errno(e)),
                };
            }
            FS_IOC_SETFLAGS => {
                // The kernel checks the caller's right to these flags (fileattr_set_prepare)
                // before it sends FS_IOC_SETFLAGS; checked here again, since a raw ioctl with
                // another encoding of the command could arrive unchecked.
                let Some(f) = in_data.get(..4).map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes"))) else {
                    return reply.error(Errno::EINVAL);
                };
                if let Err(e) = self.may_set_flags(req, ino.0, f) {
                    return reply.error(e);
                }
                // Nothing is copied back (the kernel asks for no output).
                return match self.fs.set_flags(ino.0, f) {
                    Ok(()) => {
                        self.attrs_changed(ino);
                        reply.ioctl(0, &[])
                    }
                    Err(e) => reply.error(errno(e)),
                };
            }
            FS_IOC_GETVERSION | FS_IOC32_GETVERSION => {
                return match self.fs.getattr(ino.0) {
                    Ok(m) => reply.ioctl(0, &(generation(&m).0 as u32).to_ne_bytes()),
                    Err(e) => reply.error(errno(e)),
                };
            }
            FS_IOC_FSGETXATTR => {
                return match self.fs.get_flags(ino.0) {
                    Ok(f) => {
                        let mut x = [0u8; 28];
                        x[..4].copy_from_slice(&xflags_of(f).to_ne_bytes());
                        reply.ioctl(0, &x)
                    }
                    Err(e) => reply.error(errno(e)),
                };
            }
            FS_IOC_FSSETXATTR => {
                let Some(x) = in_data.get(..4).map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes"))) else {
                    return reply.error(Errno::EINVAL);
                };
                let r = match flags_of_xflags(x) {
                    Ok(f) => match self.may_set_flags(req, ino.0, f) {
                        Ok(()) => self.fs.set_flags(ino.0, f),
                        Err(e) => return reply.error(e),
                    },
                    Err(e) => Err(e),
                };
                return match r {
                    Ok(()) => {
                        self.attrs_changed(ino);
                        reply.ioctl(0, &[])
                    }
                    Err(e) => reply.error(errno(e)),
                };
            }
            XFS_IOC_GOINGDOWN => {}
            _ => return reply.error(Errno::from_i32(libc::ENOTTY)),
        }
        // XFS's rule: CAP_SYS_ADMIN (bit 21), not merely uid 0.
        if req.uid() != 0 || !has_cap(req.pid(), 21) {
            return reply.error(Errno::EPERM);
        }
        let flags = match caller_ioctl_arg(req.pid(), cmd) {
            Ok(f) => f,
            Err(e) => {
                say!("pwfs: XFS_IOC_GOINGDOWN from pid {}: cannot read its flags: {e}", req.pid());
                return reply.error(Errno::EINVAL);
            }
        };
        let Some(mode) = pwfs::GoingDown::from_flags(flags) else { return reply.error(Errno::EINVAL) };
        let flushed = self.fs.go_down(mode);
        say!("pwfs: shut down by XFS_IOC_GOINGDOWN ({mode:?}); every operation fails with EIO now");
        if let Some(finished) = self.forget_kernel_caches() {
            // Bounded: an invalidation stuck behind a page lock must not hang the caller.
            let _ = finished.recv_timeout(Duration::from_secs(2));
        }
        match flushed {
            // Nothing copied back: the caller's flags stay as they were.
            Ok(()) => reply.ioctl(0, &[]),
            // Down all the same, but the flush asked for before it failed: the caller
            // must not believe the log reached the disk.
            Err(e) => {
                say!("pwfs: flush before the shutdown failed: {e}");
                reply.error(Errno::EIO)
            }
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let made = self.fs.mknod(parent.0, name.as_bytes(), mode, 0, &creator(req, mode, umask)).and_then(|m| {
            if self.counts_handles() {
                self.fs.open_ino(m.ino)
            } else {
                Ok(m)
            }
        });
        self.created(reply, made, flags, false);
    }

    /// open(2) with O_TMPFILE: a file with no name, open; `linkat` names it (`link`),
    /// unless it was opened O_EXCL.
    fn tmpfile(&self, req: &Request, parent: INodeNo, mode: u32, umask: u32, flags: i32, reply: ReplyCreate) {
        let linkable = flags & libc::O_EXCL == 0;
        let made = self.fs.tmpfile(parent.0, mode, &creator(req, mode, umask), linkable);
        // `Fs::tmpfile` returns it open; where handles are not counted, the lookup
        // reference taken by `created` holds it instead.
        self.created(reply, made, flags, !self.counts_handles());
    }
}

/// The flags argument of the ioctl thread `tid` is blocked in: its third syscall
/// argument (from /proc/TID/syscall) is the address of a `u32` in its memory.
fn caller_ioctl_arg(tid: u32, cmd: u32) -> std::io::Result<u32> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let line = std::fs::read_to_string(format!("/proc/{tid}/syscall"))?;
    let mut words = line.split_whitespace();
    let nr: i64 = words.next().and_then(|w| w.parse().ok()).ok_or_else(|| bad("not in a system call"))?;
    if nr != libc::SYS_ioctl {
        return Err(bad("not in ioctl(2)"));
    }
    let args: Vec<u64> =
        words.take(3).filter_map(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16).ok()).collect();
    if args.len() != 3 || args[1] as u32 != cmd {
        return Err(bad("in another ioctl"));
    }
    let mut value = 0u32;
    let local = libc::iovec { iov_base: (&mut value as *mut u32).cast(), iov_len: 4 };
    let remote = libc::iovec { iov_base: args[2] as *mut libc::c_void, iov_len: 4 };
    // SAFETY: reads 4 bytes of another process into `value`, which is 4 bytes.
    let n = unsafe { libc::process_vm_readv(tid as libc::pid_t, &local, 1, &remote, 1, 0) };
    match n {
        4 => Ok(value),
        -1 => Err(std::io::Error::last_os_error()),
        _ => Err(bad("short read of the argument")),
    }
}

/// fuser's configuration: `allow_other` only when asked for; one serving thread per
/// CPU (at least two), each with its own /dev/fuse fd.
pub fn options(allow_other: bool, threads: usize) -> fuser::Config {
    let mut config = fuser::Config::default();
    config.mount_options =
        vec![MountOption::FSName("pwfs".into()), MountOption::Subtype("pwfs".into()), MountOption::DefaultPermissions];
    if allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(threads.max(1));
    config.clone_fd = true;
    config.uring_spin = URING_SPIN;
    config
}

/// The fuse module's switch for FUSE over io_uring (Linux 6.14+, `CONFIG_FUSE_IO_URING`):
/// off by default; the kernel offers the ring to the mounts made while it is on.
pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Whether the kernel offers FUSE over io_uring to a mount made now.
pub fn uring_offered() -> bool {
    std::fs::read_to_string(ENABLE_URING).is_ok_and(|v| v.trim() == "Y")
}

/// `enable_uring` turned on while this lives and put back as it was when dropped (for
/// benchmarks and tests; a connection keeps what it agreed at INIT, but keep this alive
/// as long as the mounts made under it, see docs/DECISIONS.md).
#[derive(Debug)]
pub struct EnableUring {
    was: String,
}

impl EnableUring {
    /// Errors: the kernel has no such switch, or it cannot be written (not root).
    pub fn on() -> std::io::Result<EnableUring> {
        let was = std::fs::read_to_string(ENABLE_URING)?.trim().to_string();
        std::fs::write(ENABLE_URING, "Y")?;
        Ok(EnableUring { was })
    }
}

impl Drop for EnableUring {
    fn drop(&mut self) {
        let _ = std::fs::write(ENABLE_URING, &self.was);
    }
}

/// With FUSE over io_uring, how long the thread that answered last polls for the next
/// request while no other is being served (yielding to any runnable thread), before it
/// sleeps: a synchronous caller's next request comes within it, and is taken without a
/// wake-up. 4 KiB direct reads through the mount, one caller, mounts side by side:
/// 13.7-13.8 µs with it against 16.0-16.2 µs over /dev/fuse; without it the ring was no
/// faster than /dev/fuse (docs/DECISIONS.md, "FUSE over io_uring").
pub const URING_SPIN: Duration = Duration::from_micros(50);

/// A file system being served in the background.
pub struct Mounted {
    session: fuser::BackgroundSession,
    unmounter: Unmounter,
    /// Stops the remount watcher.
    watching: Arc<AtomicBool>,
    view: Arc<KernelView>,
}

/// Unmounts one mount: the one this process made, and only while it is still what is
/// mounted at its mount point.
#[derive(Clone, Debug)]
pub struct Unmounter {
    mountpoint: PathBuf,
    /// The mount's id in /proc/self/mountinfo (`None` when fusermount3 mounted it).
    id: Option<u64>,
}

impl Unmounter {
    /// Whether the mount on top at the mount point is this one (with fusermount3:
    /// whether anything is mounted there).
    pub fn is_mounted(&self) -> bool {
        match self.id {
            Some(id) => top_mount(&self.mountpoint).is_some_and(|m| m.id == id),
            None => true,
        }
    }

    /// Unmount if the mount on top at the mount point is still this one; `Ok(false)`
    /// when it is not (someone unmounted it, and what is there now is not ours). The
    /// kernel finishes releasing files asynchronously after their last close, so a
    /// busy mount point is retried for a while before giving up.
    pub fn unmount(&self) -> std::io::Result<bool> {
        let c = std::ffi::CString::new(self.mountpoint.as_os_str().as_bytes())?;
        let mut tries = 0;
        loop {
            if !self.is_mounted() {
                return Ok(false);
            }
            // SAFETY: plain syscall with a valid C string.
            if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
                return Ok(true);
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EPERM) && self.id.is_none() {
                let st = std::process::Command::new("fusermount3").arg("-u").arg(&self.mountpoint).status()?;
                return Ok(st.success());
            }
            if e.raw_os_error() != Some(libc::EBUSY) || tries == 50 {
                return Err(e);
            }
            tries += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Mounted {
    /// The FUSE-over-io_uring entries serving this mount (one per serving thread, the
    /// threads spread over the CPUs' queues); 0 when /dev/fuse serves it (the kernel does
    /// not offer the ring, `dev_fuse_only`, or the ring was turned off) or until the
    /// threads, which register just after the mount returns, have all done so.
    pub fn ring_entries(&self) -> usize {
        self.session.ring_entries()
    }

    /// Unmount (if the mount is still ours) and wait for the serving threads (the
    /// engine syncs at unmount).
    pub fn unmount(self) -> std::io::Result<()> {
        self.unmounter.unmount()?;
        self.join()
    }

    /// Wait until someone else unmounts the file system.
    pub fn join(self) -> std::io::Result<()> {
        let r = self.session.join();
        self.watching.store(false, Ordering::Release);
        r
    }

    /// What the kernel caches of the mount's files, to drop when they change behind its
    /// back (active with `MountOptions::shim`).
    pub fn view(&self) -> Arc<KernelView> {
        self.view.clone()
    }

    /// What unmounts this mount from another thread.
    pub fn unmounter(&self) -> Unmounter {
        self.unmounter.clone()
    }
}

/// Whether this process can mount (root, and /dev/fuse present).
pub fn can_mount() -> bool {
    // SAFETY: plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    root && std::path::Path::new("/dev/fuse").exists()
}

/// Serving threads when the mount options do not say: four per CPU, at least 16. A
/// serving thread waits while its request waits — for the device (a cold read), for a
/// commit (fsync), for write-back (throttled writes) — and fsyncs share a commit only if
/// they are in the engine together, so threads beyond the CPUs are what lets a busy
/// mount overlap its waits. `pwfs bench fuse --quick`, 2 CPUs, ratios to ext4 in each
/// run (2 / 8 / 16 threads): varmail-like 0.33 / 0.51 / 0.65, fileserver-like 0.70 /
/// 0.78 / 0.91, untar 0.93 / 0.89 / 0.71 of ext4's time (docs/BENCHMARKS.md). (An older
/// measurement, before lookups left the metadata lock, had untar slower at 4 threads
/// than at 2.)
pub fn default_threads() -> usize {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    (4 * cpus).max(16)
}

/// Serve `fs` at `mountpoint` on background threads, with the default options.
pub fn mount(fs: Fs, mountpoint: &Path, allow_other: bool) -> std::io::Result<Mounted> {
    mount_with(fs, mountpoint, &MountOptions { allow_other, ..Default::default() })
}

/// Serve `fs` at `mountpoint` on background threads.
pub fn mount_with(fs: Fs, mountpoint: &Path, o: &MountOptions) -> std::io::Result<Mounted> {
    let config = options(o.allow_other, o.threads.unwrap_or_else(default_threads));
    let read_only = o.flags & libc::MS_RDONLY != 0;
    if read_only {
        fs.set_read_only(true).map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
    }
    let notifier = Arc::new(OnceLock::new());
    // The kernel's copy of a page may hold bytes the engine lost (a write-through
    // write that became a patch, whose page then could not be read): it is dropped,
    // on another thread (the page may be locked by the request that saw the loss).
    // One thread for them all (a failing device can lose many pages): it ends when the
    // engine drops the hook.
    let told: Arc<OnceLock<fuser::Notifier>> = notifier.clone();
    let (lost, pages) = std::sync::mpsc::channel::<(u64, u64)>();
    std::thread::Builder::new().name("pwfs-lost".into()).spawn(move || {
        for (ino, page) in pages {
            if let Some(n) = told.get() {
                let at = (page * pwfs::format::BLOCK) as i64;
                let _ = n.inval_inode(INodeNo(ino), at, pwfs::format::BLOCK as i64);
            }
        }
    })?;
    fs.on_lost_writes(move |ino, page| {
        let _ = lost.send((ino, page));
    });
    let view = Arc::new(KernelView::new(o.shim, notifier.clone()));
    let pw = PwFuse {
        fs: fs.clone(),
        cache: o.kernel_cache,
        uring: !o.dev_fuse_only,
        lookups: Default::default(),
        notifier: notifier.clone(),
        view: view.clone(),
    };
    let mountpoint = mountpoint.canonicalize()?;
    let (session, id, dev) = match mount_sys(&mountpoint, o)? {
        Some((fd, m)) => {
            // The kernel admits callers itself (allow_other or the mounting user); fuser's
            // own filter would refuse what it admitted with another file-system uid
            // (setfsuid, an NFS export's knfsd).
            let session = fuser::Session::from_fd(pw, fd, fuser::SessionACL::All, config).and_then(|s| {
                let _ = notifier.set(s.notifier());
                s.spawn()
            });
            match session {
                Ok(s) => (s, Some(m.id), Some(m.dev)),
                Err(e) => {
                    detach(&mountpoint);
                    return Err(e);
                }
            }
        }
        // Not allowed to mount: fusermount3 does it (and shows type `fuse.pwfs` itself).
        // Its session tells the kernel of changes behind it too (the shim's writes).
        None => {
            let s = fuser::spawn_mount(pw, &mountpoint, &config)?;
            let _ = notifier.set(s.notifier());
            (s, None, None)
        }
    };
    if o.kernel_cache != KernelCache::Off {
        tune_bdi(&mountpoint, dev, o.kernel_cache);
    }
    let watching = Arc::new(AtomicBool::new(true));
    if let Some(id) = id {
        let (fs, watching) = (fs.clone(), watching.clone());
        std::thread::Builder::new()
            .name("pwfs-remounts".into())
            .spawn(move || watch_remounts(fs, id, read_only, &watching))?;
    }
    Ok(Mounted { session, unmounter: Unmounter { mountpoint, id }, watching, view })
}

/// A line of /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    pub id: u64,
    /// The file system's device number (st_dev of its files).
    pub dev: u64,
    pub mountpoint: PathBuf,
    /// The per-mount options (`rw,nosuid,nodev,relatime`).
    pub options: String,
    pub fs_type: String,
    pub source: String,
    /// The superblock is read-only (the super options say `ro`).
    pub read_only: bool,
}

/// Every mount of this process's namespace, bottom to top.
pub fn mountinfo() -> std::io::Result<Vec<MountInfo>> {
    Ok(std::fs::read_to_string("/proc/self/mountinfo")?.lines().filter_map(parse_mountinfo).collect())
}

/// `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`
fn parse_mountinfo(line: &str) -> Option<MountInfo> {
    let (left, right) = line.split_once(" - ")?;
    let l: Vec<&str> = left.split(' ').collect();
    let r: Vec<&str> = right.split(' ').collect();
    let (major, minor) = l.get(2)?.split_once(':')?;
    Some(MountInfo {
        id: l.first()?.parse().ok()?,
        dev: libc::makedev(major.parse().ok()?, minor.parse().ok()?),
        mountpoint: PathBuf::from(std::ffi::OsString::from_vec(unescape(l.get(4)?))),
        options: l.get(5)?.to_string(),
        fs_type: String::from_utf8_lossy(&unescape(r.first()?)).into_owned(),
        source: String::from_utf8_lossy(&unescape(r.get(1)?)).into_owned(),
        read_only: r.get(2)?.split(',').any(|o| o == "ro"),
    })
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// What is mounted on top at `mountpoint` (the last of its lines in mountinfo).
pub fn top_mount(mountpoint: &Path) -> Option<MountInfo> {
    mountinfo().ok()?.into_iter().rev().find(|m| m.mountpoint == mountpoint)
}

/// Mount /dev/fuse at `mountpoint` (canonical) with mount(2); `None` when not allowed
/// (not root). Returns the /dev/fuse fd to serve and our mount's mountinfo line.
fn mount_sys(mountpoint: &Path, o: &MountOptions) -> std::io::Result<Option<(std::os::fd::OwnedFd, MountInfo)>> {
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::fs::MetadataExt;
    let root_mode = std::fs::metadata(mountpoint)?.mode() & libc::S_IFMT;
    let fuse: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::NotFound => " (no FUSE here: `modprobe fuse`; in a container, --device /dev/fuse)",
                std::io::ErrorKind::PermissionDenied => " (in a container: --device /dev/fuse --cap-add SYS_ADMIN)",
                _ => "",
            };
            std::io::Error::new(e.kind(), format!("/dev/fuse: {e}{hint}"))
        })?
        .into();
    // SAFETY: plain syscalls.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let mut data =
        format!("fd={},rootmode={root_mode:o},user_id={uid},group_id={gid},default_permissions", fuse.as_raw_fd());
    if o.allow_other {
        data += ",allow_other";
    }
    let mut flags = o.flags;
    if !o.suid {
        flags |= libc::MS_NOSUID;
    }
    if !o.dev {
        flags |= libc::MS_NODEV;
    }
    let cstr = |s: &[u8]| {
        std::ffi::CString::new(s).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a name"))
    };
    let source = cstr(o.fsname.as_deref().unwrap_or("pwfs").as_bytes())?;
    let target = cstr(mountpoint.as_os_str().as_bytes())?;
    let (fstype, data) = (cstr(FS_TYPE.as_bytes())?, cstr(data.as_bytes())?);
    // SAFETY: valid C strings; the data is the fuse option string.
    let r = unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, data.as_ptr().cast()) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EPERM) {
            return Ok(None);
        }
        return Err(std::io::Error::new(e.kind(), format!("mount(2) of {FS_TYPE} at {}: {e}", mountpoint.display())));
    }
    match top_mount(mountpoint).filter(|m| m.fs_type == FS_TYPE) {
        Some(m) => Ok(Some((fuse, m))),
        None => {
            detach(mountpoint);
            Err(std::io::Error::other(format!(
                "{}: the new mount is not in /proc/self/mountinfo",
                mountpoint.display()
            )))
        }
    }
}

/// Lazily detach a mount that will not be served.
fn detach(mountpoint: &Path) {
    if let Ok(c) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) {
        // SAFETY: plain syscall with a valid C string.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Pass remounts on to the engine: `mount -o remount,ro` makes the superblock read-only
/// in the kernel (which then refuses every change with EROFS; a FUSE server is not told),
/// and this sees it in mountinfo — woken by the mount table's change events, or once a
/// second — and commits, checkpoints and marks the image clean (`Fs::set_read_only`);
/// `remount,rw` turns the engine writable again. Ends when the mount is gone.
fn watch_remounts(fs: Fs, id: u64, mut read_only: bool, watching: &AtomicBool) {
    use std::os::fd::AsRawFd;
    let Ok(table) = std::fs::File::open("/proc/self/mountinfo") else { return };
    while watching.load(Ordering::Acquire) {
        let mut p = libc::pollfd { fd: table.as_raw_fd(), events: libc::POLLPRI, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 1000) };
        let Ok(all) = mountinfo() else { return };
        let Some(m) = all.into_iter().find(|m| m.id == id) else { return };
        if m.read_only != read_only {
            read_only = m.read_only;
            match fs.set_read_only(read_only) {
                Ok(()) => say!("pwfs: remounted {}", if read_only { "read-only" } else { "read-write" }),
                Err(e) => say!("pwfs: remount: {e}"),
            }
        }
    }
}

/// Kernel readahead of the mount, in KiB: a cold sequential read through the kernel's
/// cache is one request per this much (the kernel's default of 128 KiB made 1 MiB reads
/// half as fast as with direct I/O).
const READAHEAD_KB: u32 = 1024;

/// Share of the dirty-page threshold the kernel lets the mount's pages take in
/// write-back mode (percent; FUSE's own default is 1, with a strict limit).
pub const WRITEBACK_MAX_RATIO: u32 = 50;

/// Tune the kernel's backing device info of the new mount (sysfs). Readahead: the
/// kernel caps FUSE's at 128 KiB when it mounts. Write-back mode: FUSE also holds a
/// mount to 1% of the dirty threshold, strictly (`strict_limit`), which guards the
/// kernel against a server that never writes pages back; with this trusted one it only
/// throttled writers (8 KiB random writes: 94-99k/s against 285-294k/s with the limit
/// lifted, docs/BENCHMARKS.md). The mount then gets a share as a disk does. Best
/// effort: without it I/O is only slower. `dev`: the mount's device number when known
/// (else it is stat'ed).
fn tune_bdi(mountpoint: &Path, dev: Option<u64>, cache: KernelCache) {
    use std::os::unix::fs::MetadataExt;
    let dev = match dev {
        Some(d) => d,
        None => match std::fs::metadata(mountpoint) {
            Ok(md) => md.dev(),
            Err(_) => return,
        },
    };
    let bdi = format!("/sys/class/bdi/{}:{}", libc::major(dev), libc::minor(dev));
    let mut knobs = vec![("read_ahead_kb", READAHEAD_KB)];
    if cache == KernelCache::WriteBack {
        knobs.extend([("strict_limit", 0), ("max_ratio", WRITEBACK_MAX_RATIO)]);
    }
    for (knob, value) in knobs {
        let path = format!("{bdi}/{knob}");
        if let Err(e) = std::fs::write(&path, value.to_string()) {
            say!("pwfs: cannot set {path} to {value}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_and_escapes() {
        let l = r"612 30 0:77 / /tmp/a\040b\134c rw,nosuid,nodev,relatime shared:1 - fuse.pwfs /img\040x ro,user_id=0";
        let m = parse_mountinfo(l).unwrap();
        assert_eq!(m.id, 612);
        assert_eq!(m.dev, libc::makedev(0, 77));
        assert_eq!(m.mountpoint, Path::new("/tmp/a b\\c"));
        assert_eq!(m.options, "rw,nosuid,nodev,relatime");
        assert_eq!((m.fs_type.as_str(), m.source.as_str(), m.read_only), ("fuse.pwfs", "/img x", true));
        assert!(parse_mountinfo("garbage").is_none());
        assert_eq!(unescape(r"a\04"), b"a\\04");
    }

    /// Every stored time converts to the kernel's form and back unchanged, the ends
    /// of `i64` included (a user may set any of them with utimensat).
    #[test]
    fn times_convert_both_ways_at_every_range() {
        let cases = [
            (i64::MIN, 0),
            (i64::MIN, 1),
            (i64::MIN + 1, 999_999_999),
            (-1, 500_000_000),
            (-1, 0),
            (0, 0),
            (0, 1),
            (1_700_000_000, 123_456_789),
            (i64::MAX, 0),
            (i64::MAX, 999_999_999),
        ];
        for (sec, nsec) in cases {
            let t = Timespec { sec, nsec };
            assert_eq!(timespec(time(t)), t, "{sec}.{nsec}");
        }
        let half_before = time(Timespec { sec: -1, nsec: 500_000_000 });
        assert_eq!(UNIX_EPOCH.duration_since(half_before).unwrap(), Duration::from_millis(500));
    }

    /// A reference to an inode freed since its attributes were read is refused and
    /// counts nothing (a FORGET racing a lookup by handle); a counted one holds the
    /// inode past its unlink until the kernel forgets it.
    #[test]
    fn the_kernels_references_are_counted_only_for_live_inodes() {
        let dev = Arc::new(pwfs::device::mem::MemDevice::new(32 << 20));
        pwfs::mkfs(&*dev, &pwfs::MkfsOptions::default()).unwrap();
        let fs = Fs::mount(dev, pwfs::Config { cache_bytes: 4 << 20, ..Default::default() }).unwrap();
        let notifier = Arc::new(OnceLock::new());
        let pw = PwFuse {
            fs: fs.clone(),
            cache: KernelCache::WriteThrough,
            uring: false,
            lookups: Default::default(),
            notifier: notifier.clone(),
            view: Arc::new(KernelView::new(false, notifier)),
        };
        fs.write_file("/held", b"x").unwrap();
        fs.write_file("/gone", b"y").unwrap();
        let (held_md, gone_md) = (fs.metadata("/held").unwrap(), fs.metadata("/gone").unwrap());
        let (held, gone) = (held_md.ino, gone_md.ino);
        assert!(pw.remember(&held_md));
        fs.remove_file("/held").unwrap();
        fs.remove_file("/gone").unwrap();
        assert!(fs.getattr(held).is_ok(), "a counted reference holds the unlinked inode");
        assert!(fs.getattr(gone).is_err(), "nothing held the other one");
        assert!(!pw.remember(&gone_md), "a freed inode is not handed out");
        assert!(!pw.lookups.lock().unwrap().contains_key(&gone), "and leaves no count behind");
        pw.forget_n(held, 1);
        assert!(fs.getattr(held).is_err(), "freed once the kernel forgets it");
        // The freed number taken by a new file: the old attributes are not handed out
        // as that number, whether the kernel holds the new file or not.
        let reused = (0..8)
            .map(|i| {
                let p = format!("/new{i}");
                fs.write_file(&p, b"n").unwrap();
                fs.metadata(&p).unwrap()
            })
            .find(|m| m.ino == gone)
            .expect("a new file takes the freed number");
        assert_ne!(reused.generation, gone_md.generation);
        assert!(!pw.remember(&gone_md), "stale attributes of a reused number, not held");
        assert!(!pw.lookups.lock().unwrap().contains_key(&gone), "and no count left behind");
        assert!(fs.getattr(gone).is_ok(), "nor the new file's handle taken away");
        assert!(pw.remember(&reused));
        assert!(!pw.remember(&gone_md), "stale attributes of a reused number, held");
        assert_eq!(pw.lookups.lock().unwrap()[&gone].0, 1);
        pw.forget_n(gone, 1);
        drop(pw);
        fs.unmount().unwrap();
    }
}
