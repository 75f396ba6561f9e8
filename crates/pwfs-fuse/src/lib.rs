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

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig,
    MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use pwfs::format::Timespec;
use pwfs::{Creator, Fs, Metadata, SetAttr, TimeSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
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
}
/// Largest write the kernel sends in one request.
const MAX_WRITE: u32 = 1 << 20;

struct PwFuse {
    fs: Fs,
    cache: KernelCache,
    /// The kernel's lookup count per inode. While it is not zero the inode holds an
    /// engine handle (like an open file), so an unlinked inode is not freed and its
    /// number not reused before the kernel forgets it: FUSE node ids must stay unique
    /// until then.
    lookups: std::sync::Mutex<std::collections::HashMap<u64, u64>>,
    /// Tells the kernel what the engine changed behind it: set once the session runs.
    notifier: std::sync::Arc<std::sync::OnceLock<fuser::Notifier>>,
}

impl PwFuse {
    /// Reply with an entry and count the kernel's new reference to it.
    fn entry(&self, reply: ReplyEntry, r: pwfs::Result<Metadata>) {
        match r {
            Ok(m) => {
                self.remember(m.ino);
                reply.entry(&TTL, &attr(&m), Generation(m.generation as u64))
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn remember(&self, ino: u64) {
        let mut l = self.lookups.lock().expect("lookup table");
        let n = l.entry(ino).or_insert(0);
        if *n == 0 && self.fs.open_ino(ino).is_err() {
            return;
        }
        *n += 1;
    }

    fn forget_n(&self, ino: u64, n: u64) {
        let mut l = self.lookups.lock().expect("lookup table");
        if let Some(c) = l.get_mut(&ino) {
            *c = c.saturating_sub(n);
            if *c == 0 {
                l.remove(&ino);
                self.fs.release_ino(ino);
            }
        }
    }
}

fn errno(e: pwfs::Error) -> Errno {
    Errno::from_i32(e.errno())
}

fn time(t: Timespec) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::new((-t.sec) as u64, 0) + Duration::from_nanos(t.nsec as u64)
    }
}

fn timespec(t: SystemTime) -> Timespec {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Timespec { sec: d.as_secs() as i64, nsec: d.subsec_nanos() },
        Err(e) => {
            let d = e.duration();
            let (mut sec, mut nsec) = (-(d.as_secs() as i64), d.subsec_nanos());
            if nsec > 0 {
                sec -= 1;
                nsec = 1_000_000_000 - nsec;
            }
            Timespec { sec, nsec }
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
        // write-back errors. Other write handles keep the flush: close reports a
        // non-blocking write lost after it returned.
        let noflush = if read_only || created { FopenFlags::FOPEN_NOFLUSH } else { FopenFlags::empty() };
        match self.cache {
            KernelCache::Off => FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES | noflush,
            KernelCache::WriteThrough | KernelCache::WriteBack => FopenFlags::FOPEN_KEEP_CACHE | noflush,
        }
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
                // The kernel checks POSIX ACLs (read from here with getxattr), and
                // leaves the umask to us: a new inode under a default ACL ignores it.
                | InitFlags::FUSE_POSIX_ACL
                | InitFlags::FUSE_DONT_MASK,
        );
        if self.cache != KernelCache::Off {
            let _ = config.add_capabilities(InitFlags::FUSE_NO_OPENDIR_SUPPORT);
        }
        if self.cache == KernelCache::WriteBack {
            let _ = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE);
        }
        Ok(())
    }

    fn destroy(&mut self) {
        // The kernel sends no forgets at unmount: drop its references here, so that
        // files unlinked while it held them are freed by the final sync.
        let held: Vec<(u64, u64)> = self.lookups.lock().expect("lookup table").drain().collect();
        for (ino, _) in held {
            self.fs.release_ino(ino);
        }
        // Unmount: everything durable, the journal empty.
        if let Err(e) = self.fs.sync() {
            eprintln!("pwfs: sync at unmount failed: {e}");
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.forget_n(ino.0, nlookup);
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.entry(reply, self.fs.lookup(parent.0, name.as_bytes()))
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(m) => reply.attr(&TTL, &attr(&m)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
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
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time_set),
            mtime: mtime.map(time_set),
            ctime: ctime.map(timespec),
            // The kernel sends the mode it wants when a truncate or chown clears
            // set-id bits (FUSE_HANDLE_KILLPRIV is not negotiated).
            kill_setid: false,
        };
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
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.contains(RenameFlags::RENAME_EXCHANGE) || !(flags - RenameFlags::RENAME_NOREPLACE).is_empty() {
            return reply.error(Errno::EINVAL);
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        empty(reply, self.fs.rename(parent.0, name.as_bytes(), newparent.0, newname.as_bytes(), noreplace))
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        self.entry(reply, self.fs.link(ino.0, newparent.0, newname.as_bytes()))
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // O_TRUNC never arrives here: without FUSE_ATOMIC_O_TRUNC the kernel checks write
        // access (ETXTBSY) first and then truncates with a setattr.
        match self.fs.open_ino(ino.0) {
            Ok(_) => reply.opened(FileHandle(0), self.open_flags(flags.0, false)),
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
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        let mut buf = vec![0u8; size as usize];
        match self.fs.read(ino.0, offset, &mut buf) {
            Ok(n) => reply.data(&buf[..n]),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        // The writer lacks CAP_FSETID: set-id bits go first. The kernel says so on
        // every direct write (KernelCache::Off); in the cached modes it clears them
        // itself with a setattr before the write (no FUSE_HANDLE_KILLPRIV_V2: see
        // docs/DECISIONS.md).
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            match self.fs.remove_privs(ino.0) {
                // The kernel keeps the mode it had cached after a direct write: drop
                // its attributes (offset -1: not its pages, which this write may hold).
                Ok(true) => {
                    if let Some(n) = self.notifier.get() {
                        let _ = n.inval_inode(ino, -1, 0);
                    }
                }
                Ok(false) => {}
                Err(e) => return reply.error(errno(e)),
            }
        }
        // O_APPEND is resolved by the kernel into the offset it sends.
        match self.fs.write(ino.0, offset, data, false) {
            Ok(_) => reply.written(data.len() as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Every close(2) of a handle: reports a write to this file that was lost after it
    /// returned (non-blocking writes, whose page then could not be read). It costs one
    /// round trip per close and waits for no I/O.
    fn flush(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _lock_owner: fuser::LockOwner, reply: ReplyEmpty) {
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
        self.fs.release_ino(ino.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.fs.fsync(ino.0, datasync))
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
        match self.fs.readdir(ino.0, offset, 256) {
            Ok(entries) => {
                for e in entries {
                    // By name, not by the listed number: an entry removed since the
                    // directory was read is left out, and one whose number went to
                    // another file meanwhile is not given that file's attributes.
                    let Ok(md) = self.fs.lookup(ino.0, &e.name) else { continue };
                    let dot = e.name == b"." || e.name == b"..";
                    let full = reply.add(
                        INodeNo(md.ino),
                        e.next,
                        OsStr::from_bytes(&e.name),
                        &TTL,
                        &attr(&md),
                        Generation(md.generation as u64),
                    );
                    if full {
                        break;
                    }
                    if !dot {
                        self.remember(md.ino);
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.fs.fsync(ino.0, datasync))
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let (create, replace) = (flags & libc::XATTR_CREATE != 0, flags & libc::XATTR_REPLACE != 0);
        empty(reply, self.fs.setxattr(ino.0, name.as_bytes(), value, create, replace))
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.fs.getxattr(ino.0, name.as_bytes()) {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.fs.listxattr(ino.0) {
            Ok(names) => {
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
        empty(reply, self.fs.removexattr(ino.0, name.as_bytes()))
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
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
        let made = self
            .fs
            .mknod(parent.0, name.as_bytes(), mode, 0, &creator(req, mode, umask))
            .and_then(|m| self.fs.open_ino(m.ino));
        match made {
            Ok(m) => {
                self.remember(m.ino);
                reply.created(
                    &TTL,
                    &attr(&m),
                    Generation(m.generation as u64),
                    FileHandle(0),
                    self.open_flags(flags, true),
                )
            }
            Err(e) => reply.error(errno(e)),
        }
    }
}

/// Mount options: `default_permissions` (the kernel checks permissions), and
/// `allow_other` only when asked for.
pub fn options(allow_other: bool, threads: usize) -> fuser::Config {
    let mut config = fuser::Config::default();
    config.mount_options =
        vec![MountOption::FSName("pwfs".into()), MountOption::Subtype("pwfs".into()), MountOption::DefaultPermissions];
    if allow_other {
        config.acl = fuser::SessionACL::All;
    }
    config.n_threads = Some(threads.max(1));
    config.clone_fd = true;
    config
}

/// A file system being served in the background.
pub struct Mounted {
    session: fuser::BackgroundSession,
    mountpoint: std::path::PathBuf,
}

impl Mounted {
    /// Unmount and wait for the serving threads (the engine syncs at unmount). The
    /// kernel finishes releasing files asynchronously after their last close, so a
    /// busy mount point is retried for a while before giving up.
    pub fn unmount(self) -> std::io::Result<()> {
        let c = std::ffi::CString::new(self.mountpoint.as_os_str().as_bytes())?;
        let mut tries = 0;
        loop {
            // SAFETY: plain syscall with a valid C string.
            if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EBUSY) || tries == 50 {
                return Err(e);
            }
            tries += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
        self.session.join()
    }

    /// Wait until someone else unmounts the file system.
    pub fn join(self) -> std::io::Result<()> {
        self.session.join()
    }
}

/// Whether this process can mount (root, and /dev/fuse present).
pub fn can_mount() -> bool {
    // SAFETY: plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    root && std::path::Path::new("/dev/fuse").exists()
}

/// Serve `fs` at `mountpoint` on background threads, with the default options.
pub fn mount(fs: Fs, mountpoint: &Path, allow_other: bool) -> std::io::Result<Mounted> {
    mount_with(fs, mountpoint, &MountOptions { allow_other, ..Default::default() })
}

/// Serve `fs` at `mountpoint` on background threads.
pub fn mount_with(fs: Fs, mountpoint: &Path, o: &MountOptions) -> std::io::Result<Mounted> {
    // One serving thread per CPU (at least two): measured on 2 CPUs, untar of
    // /usr/include took 7.8 s with 1 thread, 2.4 s with 2 and 3.3 s with 4.
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).max(2);
    let notifier = std::sync::Arc::new(std::sync::OnceLock::new());
    let session = fuser::spawn_mount(
        PwFuse { fs, cache: o.kernel_cache, lookups: Default::default(), notifier: notifier.clone() },
        mountpoint,
        &options(o.allow_other, threads),
    )?;
    let _ = notifier.set(session.notifier());
    if o.kernel_cache != KernelCache::Off {
        raise_readahead(mountpoint);
    }
    Ok(Mounted { session, mountpoint: mountpoint.to_path_buf() })
}

/// Kernel readahead of the mount, in KiB: a cold sequential read through the kernel's
/// cache is one request per this much (the kernel's default of 128 KiB made 1 MiB reads
/// half as fast as with direct I/O).
const READAHEAD_KB: u32 = 1024;

/// Raise the kernel's readahead for the new mount (its backing device info in sysfs;
/// the kernel caps FUSE's at 128 KiB when it mounts). Best effort: without it reads are
/// only slower.
fn raise_readahead(mountpoint: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(mountpoint) else { return };
    let dev = md.dev();
    let path = format!("/sys/class/bdi/{}:{}/read_ahead_kb", libc::major(dev), libc::minor(dev));
    if let Err(e) = std::fs::write(&path, READAHEAD_KB.to_string()) {
        eprintln!("pwfs: cannot raise readahead ({path}): {e}");
    }
}
