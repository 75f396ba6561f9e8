//! The path-based Rust API: `Fs::open`, `File`, `OpenOptions`, `Metadata`, and
//! directory iteration, built on the inode-level operations.
//!
//! Paths are taken relative to the root of the file system ("/a/b" and "a/b" name
//! the same file). Symlinks are followed (at most 40 per lookup, then ELOOP), except
//! in the last component where the operation says so (lstat, readlink, unlink...).

use super::inode::InodeCell;
use super::perm::Creator;
use super::Fs;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self as f, Timespec};
use crate::readahead::RaState;
use parking_lot::Mutex;
use std::io;
use std::sync::Arc;

const MAX_SYMLINKS: u32 = 40;
const PATH_MAX: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    File,
    Directory,
    Symlink,
    Fifo,
    CharDevice,
    BlockDevice,
    Socket,
}

impl FileType {
    pub fn from_mode(mode: u32) -> FileType {
        match mode & f::S_IFMT {
            f::S_IFDIR => FileType::Directory,
            f::S_IFLNK => FileType::Symlink,
            f::S_IFIFO => FileType::Fifo,
            f::S_IFCHR => FileType::CharDevice,
            f::S_IFBLK => FileType::BlockDevice,
            f::S_IFSOCK => FileType::Socket,
            _ => FileType::File,
        }
    }
    pub fn from_dirent(t: u8) -> FileType {
        match t {
            4 => FileType::Directory,
            10 => FileType::Symlink,
            1 => FileType::Fifo,
            2 => FileType::CharDevice,
            6 => FileType::BlockDevice,
            12 => FileType::Socket,
            _ => FileType::File,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    pub ino: u64,
    pub kind: FileType,
    /// Type and permission bits, as st_mode.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    /// 512-byte units allocated, as st_blocks.
    pub blocks: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub generation: u32,
    pub rdev: u32,
    pub blksize: u32,
}

impl Metadata {
    pub fn is_dir(&self) -> bool {
        self.kind == FileType::Directory
    }
    pub fn is_file(&self) -> bool {
        self.kind == FileType::File
    }
    pub fn permissions(&self) -> u32 {
        self.mode & 0o7777
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    pub kind: FileType,
    pub name: Vec<u8>,
    /// Offset to pass to `readdir` to continue after this entry.
    pub next: u64,
}

/// A time `Fs::setattr` sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeSet {
    /// The present time (utimensat's UTIME_NOW).
    Now,
    /// A time the caller chose (an explicit change of times).
    At(Timespec),
    /// The present time as the caller's clock read it: the kernel's own time updates
    /// and touches when it keeps a file's times itself (FUSE write-back cache). Stored
    /// as given, counted as `Now`.
    Current(Timespec),
}

/// What kind of change `Fs::kill_privs` clears privileges for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrivChange {
    /// A write, fallocate or copy into the file by a caller.
    Write,
    /// The write-back of pages the kernel cached (FUSE_WRITE_CACHE): set-ID bits and
    /// capabilities were the caller's write's to clear.
    CachedWrite,
    /// A truncate or a change of owner.
    Attributes,
}

#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
    pub ctime: Option<Timespec>,
    /// Clear S_ISUID, and S_ISGID if group-executable, of a non-directory: what a
    /// truncate by a caller without CAP_FSETID does (`perm::setid_to_clear`). A change
    /// of owner or group does it anyway; so does a chown(2) to the same owner and group
    /// (the mount gets it as a request that sets nothing, or ctime alone, and passes it
    /// on as this).
    pub kill_setid: bool,
    /// With `kill_setid` or a change of owner or group: the caller is neither in the
    /// file's group nor holds CAP_FSETID, so S_ISGID goes even without group execute.
    pub outsider: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    pub blocks: u64,
    pub blocks_free: u64,
    pub blocks_available: u64,
    pub inodes: u64,
    pub inodes_free: u64,
    pub name_max: u32,
}

#[derive(Debug, Clone)]
pub struct OpenOptions {
    read: bool,
    write: bool,
    append: bool,
    truncate: bool,
    create: bool,
    create_new: bool,
    nofollow: bool,
    mode: u32,
    uid: u32,
    gid: u32,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions::new()
    }
}

impl OpenOptions {
    pub fn new() -> OpenOptions {
        OpenOptions {
            read: false,
            write: false,
            append: false,
            truncate: false,
            create: false,
            create_new: false,
            nofollow: false,
            mode: 0o644,
            uid: 0,
            gid: 0,
        }
    }
    pub fn read(&mut self, v: bool) -> &mut Self {
        self.read = v;
        self
    }
    pub fn write(&mut self, v: bool) -> &mut Self {
        self.write = v;
        self
    }
    /// O_APPEND: every write goes to the end of the file (implies write).
    pub fn append(&mut self, v: bool) -> &mut Self {
        self.append = v;
        self
    }
    /// O_TRUNC.
    pub fn truncate(&mut self, v: bool) -> &mut Self {
        self.truncate = v;
        self
    }
    /// O_CREAT.
    pub fn create(&mut self, v: bool) -> &mut Self {
        self.create = v;
        self
    }
    /// O_CREAT|O_EXCL.
    pub fn create_new(&mut self, v: bool) -> &mut Self {
        self.create_new = v;
        self
    }
    /// O_NOFOLLOW: a symlink in the last component is ELOOP.
    pub fn nofollow(&mut self, v: bool) -> &mut Self {
        self.nofollow = v;
        self
    }
    /// Permission bits of a created file.
    pub fn mode(&mut self, mode: u32) -> &mut Self {
        self.mode = mode;
        self
    }
    /// Owner of a created file.
    pub fn owner(&mut self, uid: u32, gid: u32) -> &mut Self {
        self.uid = uid;
        self.gid = gid;
        self
    }

    pub fn open(&self, fs: &Fs, path: impl AsRef<[u8]>) -> Result<File> {
        fs.open(path, self)
    }
}

/// An open file. Dropping it releases the handle; an unlinked file is freed when
/// its last handle goes.
pub struct File {
    fs: Fs,
    ino: u64,
    /// The inode, held: its calls need no lookup.
    cell: Arc<InodeCell>,
    /// This handle's readahead (a sequential reader per handle, as in Linux).
    ra: RaState,
    pos: Mutex<u64>,
    readable: bool,
    writable: bool,
    append: bool,
    /// Lost writes of the file this handle reported (`Fs::fsync_reporting`).
    lost_seen: std::sync::atomic::AtomicU64,
}

impl File {
    /// A handle on the inode `cell` (opened: its open count already taken), at
    /// position 0 with its own readahead.
    fn new(fs: &Fs, ino: u64, cell: Arc<InodeCell>, readable: bool, writable: bool, append: bool) -> File {
        let lost_seen = fs.lost_writes_sample(ino).into();
        File {
            fs: fs.clone(),
            ino,
            cell,
            ra: RaState::default(),
            pos: Mutex::new(0),
            readable,
            writable,
            append,
            lost_seen,
        }
    }

    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// Open for writing (or appending).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        if !self.readable {
            return Err(Error::new(ErrorKind::BadHandle, "file not open for reading"));
        }
        self.fs.read_cell(&self.cell, &self.ra, offset, buf)
    }

    /// Write `data` at `offset` (at the end of file for O_APPEND handles); returns the
    /// bytes written: all, or fewer when an error or the largest file size stopped
    /// the write after some (`Fs::write`).
    pub fn write_at(&self, data: &[u8], offset: u64) -> Result<usize> {
        if !self.writable {
            return Err(Error::new(ErrorKind::BadHandle, "file not open for writing"));
        }
        Ok(self.fs.write_cell(&self.cell, offset, data, self.append)?.1)
    }

    /// Write all of `data` at `offset` (at the end of file for O_APPEND handles), or
    /// fail: a short write is followed by another of the rest, which writes it or
    /// returns the error that stopped the first.
    pub fn write_all_at(&self, data: &[u8], offset: u64) -> Result<()> {
        let mut done = 0;
        while done < data.len() {
            let (_, n) = self.pwrite(&data[done..], offset + done as u64)?;
            if n == 0 {
                return Err(Error::io("a write made no progress"));
            }
            done += n;
        }
        Ok(())
    }

    /// pwrite(2): write `data` at `offset` (at the end of file for O_APPEND handles)
    /// and return where it went and how many bytes were written (`write_at`).
    pub fn pwrite(&self, data: &[u8], offset: u64) -> Result<(u64, usize)> {
        if !self.writable {
            return Err(Error::new(ErrorKind::BadHandle, "file not open for writing"));
        }
        self.fs.write_cell(&self.cell, offset, data, self.append)
    }

    /// Read at the file position, advancing it.
    pub fn read(&self, buf: &mut [u8]) -> Result<usize> {
        let mut pos = self.pos.lock();
        let n = self.read_at(buf, *pos)?;
        *pos += n as u64;
        Ok(n)
    }

    /// Write at the file position (or the end, for O_APPEND), advancing it.
    pub fn write(&self, data: &[u8]) -> Result<usize> {
        if !self.writable {
            return Err(Error::new(ErrorKind::BadHandle, "file not open for writing"));
        }
        let mut pos = self.pos.lock();
        let (at, n) = self.fs.write_cell(&self.cell, *pos, data, self.append)?;
        *pos = at + n as u64;
        Ok(n)
    }

    pub fn seek(&self, to: io::SeekFrom) -> Result<u64> {
        let mut pos = self.pos.lock();
        let base = match to {
            io::SeekFrom::Start(n) => {
                *pos = n;
                return Ok(n);
            }
            io::SeekFrom::Current(d) => (*pos as i64, d),
            io::SeekFrom::End(d) => (self.metadata()?.size as i64, d),
        };
        let n = base.0.checked_add(base.1).filter(|n| *n >= 0).ok_or_else(|| Error::invalid("seek before start"))?;
        *pos = n as u64;
        Ok(n as u64)
    }

    pub fn set_len(&self, size: u64) -> Result<()> {
        if !self.writable {
            return Err(Error::invalid("file not open for writing"));
        }
        self.fs.truncate(self.ino, size)
    }

    pub fn metadata(&self) -> Result<Metadata> {
        self.fs.getattr(self.ino)
    }

    /// fallocate(2): `mode` is 0 or `FALLOC_FL_*` bits (`pwfs::fs::FALLOC_FL_KEEP_SIZE`…).
    pub fn allocate(&self, mode: u32, offset: u64, len: u64) -> Result<()> {
        if !self.writable {
            return Err(Error::new(ErrorKind::BadHandle, "file not open for writing"));
        }
        self.fs.fallocate(self.ino, mode, offset, len)
    }

    /// lseek(2) with SEEK_HOLE (`hole`) or SEEK_DATA; the file position does not move.
    pub fn seek_hole_data(&self, offset: u64, hole: bool) -> Result<u64> {
        self.fs.seek_hole_data(self.ino, offset, hole)
    }

    /// fsync(2). A write of the file lost after it returned (its page could not be
    /// read) is reported once to every handle open then (EIO), as Linux does.
    pub fn sync_all(&self) -> Result<()> {
        self.fs.fsync_reporting(self.ino, false, Some(&self.lost_seen))
    }

    /// fdatasync(2), reporting as `sync_all`.
    pub fn sync_data(&self) -> Result<()> {
        self.fs.fsync_reporting(self.ino, true, Some(&self.lost_seen))
    }

    /// close(2)'s report without the close (a handle shared behind an `Arc`): a write
    /// of the file lost after it returned and not reported by this handle yet.
    pub fn report_lost_writes(&self) -> Result<()> {
        self.fs.flush_reporting(self.ino, Some(&self.lost_seen))
    }

    /// close(2): like dropping the handle, but reports a write to this file that
    /// was lost after it returned (its page could not be read). Does not wait for
    /// I/O; use `sync_all` for durability.
    pub fn close(self) -> Result<()> {
        // Only a handle that could have written reports a lost write at close.
        if !self.is_writable() {
            return Ok(());
        }
        self.fs.flush_reporting(self.ino, Some(&self.lost_seen))
        // Drop releases the handle.
    }
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "File(ino {})", self.ino)
    }
}

impl Drop for File {
    fn drop(&mut self) {
        self.fs.release_cell(&self.cell);
    }
}

impl io::Read for &File {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        File::read(self, buf).map_err(Into::into)
    }
}

impl io::Write for &File {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        File::write(self, buf).map_err(Into::into)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// How many times a path call walks again when the inode its name led to went away.
const PIN_TRIES: u32 = 64;

/// An inode held open for the length of a path call (`Fs::pin`).
struct Pin<'a> {
    fs: &'a Fs,
    /// `None` once handed on (`into_cell`).
    cell: Option<Arc<InodeCell>>,
}

impl<'a> Pin<'a> {
    fn new(fs: &'a Fs, cell: Arc<InodeCell>) -> Pin<'a> {
        Pin { fs, cell: Some(cell) }
    }

    fn ino(&self) -> u64 {
        self.cell.as_ref().expect("a pin holds its cell until handed on").ino
    }

    /// The cell, its open count handed to the caller (a `File`).
    fn into_cell(mut self) -> Arc<InodeCell> {
        self.cell.take().expect("a pin holds its cell until handed on")
    }
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            self.fs.release_cell(&cell);
        }
    }
}

/// The path without its trailing slashes ("/" stays "/").
fn trim_slashes(path: &[u8]) -> &[u8] {
    let mut end = path.len();
    while end > 1 && path[end - 1] == b'/' {
        end -= 1;
    }
    &path[..end]
}

/// Whether a name ends the path with a slash after it ("d/", not "/"): the path
/// asks for a directory.
fn trailing_slash(path: &[u8]) -> bool {
    trim_slashes(path).len() < path.len()
}

fn split_last(path: &[u8]) -> Result<(&[u8], &[u8])> {
    let trimmed = trim_slashes(path);
    match trimmed.iter().rposition(|c| *c == b'/') {
        Some(i) => Ok((&trimmed[..i + 1], &trimmed[i + 1..])),
        None => Ok((b"", trimmed)),
    }
}

impl Fs {
    /// The inode a path names, and its attributes as the lookup of its last component
    /// found them (the root's read when the path has no component).
    fn walk(&self, start: u64, path: &[u8], follow_last: bool, depth: &mut u32) -> Result<Metadata> {
        if path.len() >= PATH_MAX {
            return Err(Error::name_too_long("path longer than PATH_MAX"));
        }
        let mut cur = if path.starts_with(b"/") { f::ROOT_INO } else { start };
        let comps: Vec<&[u8]> = path.split(|c| *c == b'/').filter(|c| !c.is_empty()).collect();
        let mut found = None;
        // A trailing slash follows a symlink in the last component, as the kernel's
        // LOOKUP_DIRECTORY does (lstat("link/") is the directory's).
        let follow_last = follow_last || path.ends_with(b"/");
        for (i, c) in comps.iter().enumerate() {
            let last = i + 1 == comps.len();
            let md = self.lookup(cur, c)?;
            let md = if md.kind == FileType::Symlink && (!last || follow_last) {
                *depth += 1;
                if *depth > MAX_SYMLINKS {
                    return Err(Error::is_loop("too many levels of symbolic links"));
                }
                let target = self.readlink(md.ino)?;
                self.walk(cur, &target, true, depth)?
            } else {
                md
            };
            cur = md.ino;
            found = Some(md);
        }
        let md = match found {
            Some(md) => md,
            None => self.getattr(cur)?,
        };
        if path.ends_with(b"/") && !comps.is_empty() && !md.is_dir() {
            return Err(Error::not_dir("trailing slash on a non-directory"));
        }
        Ok(md)
    }

    /// The inode a path names, following symlinks in the last component or not. The
    /// number is not held: a concurrent unlink or rename over the name can free it
    /// and a new inode take it. The path calls below hold the inode instead (`pin`).
    pub fn resolve(&self, path: impl AsRef<[u8]>, follow: bool) -> Result<u64> {
        self.resolve_md(path.as_ref(), follow).map(|md| md.ino)
    }

    fn resolve_md(&self, path: &[u8], follow: bool) -> Result<Metadata> {
        if path.is_empty() {
            return Err(Error::not_found("empty path"));
        }
        self.walk(f::ROOT_INO, path, follow, &mut 0)
    }

    /// The inode a path names, held open (like a dentry reference in the kernel) so that
    /// an unlink or a rename over the name while the caller works on it cannot free it
    /// or give its number to another file. Returns its attributes at the time it was
    /// held and the handle that holds it.
    fn pin(&self, path: &[u8], follow: bool) -> Result<(Metadata, Pin<'_>)> {
        for _ in 0..PIN_TRIES {
            // The name's inode can go after the walk found it (and its number be taken
            // by another): then walk again.
            if let Some(held) = self.hold(&self.resolve_md(path, follow)?)? {
                return Ok(held);
            }
        }
        Err(Error::not_found("the name kept changing while it was looked up"))
    }

    /// Hold the inode `md` describes, if it is still that inode (its number not freed,
    /// nor given to another: same generation); `None` if it went away.
    fn hold(&self, md: &Metadata) -> Result<Option<(Metadata, Pin<'_>)>> {
        match self.open_cell(md.ino) {
            Ok((held, cell)) if held.generation == md.generation => Ok(Some((held, Pin::new(self, cell)))),
            Ok((_, cell)) => {
                self.release_cell(&cell);
                Ok(None)
            }
            Err(e) if e.kind == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The directory that holds the last component, and that component's name.
    /// Held (`pin`) so that it cannot be removed and its number given to another
    /// directory while the caller adds or removes the name.
    fn resolve_parent<'p>(&self, path: &'p [u8]) -> Result<(Pin<'_>, &'p [u8])> {
        if path.is_empty() {
            return Err(Error::not_found("empty path"));
        }
        let (dir, name) = split_last(path)?;
        if name.is_empty() || name == b"/" {
            return Err(Error::new(ErrorKind::Busy, "the root directory"));
        }
        let (_, parent) = self.pin(if dir.is_empty() { b"/" } else { dir }, true)?;
        Ok((parent, name))
    }

    pub fn open(&self, path: impl AsRef<[u8]>, o: &OpenOptions) -> Result<File> {
        self.open_following(path.as_ref(), o, 0)
    }

    /// `open`, `depth` dangling symlinks into an O_CREAT.
    fn open_following(&self, path: &[u8], o: &OpenOptions, depth: u32) -> Result<File> {
        let writable = o.write || o.append;
        if !o.read && !writable {
            return Err(Error::invalid("open for neither reading nor writing"));
        }
        // O_CREAT or O_TRUNC with O_RDONLY creates or truncates, as open(2) does on
        // Linux (std's OpenOptions refuses them; a C caller of `pwfs_open` expects
        // open(2)); the handle is read-only all the same.
        // As the kernel's open_last_lookups, whether the name exists or not (once the
        // directories before it are found: ENOENT, ENOTDIR first).
        if (o.create || o.create_new) && trailing_slash(path) {
            self.resolve_parent(path)?;
            return Err(Error::is_dir("O_CREAT of a name ending in '/'"));
        }
        // Whether this open created the file (then O_TRUNC has nothing to do: it is
        // empty, and its times are the creation's).
        let create = || -> Result<(Metadata, Pin<'_>, bool)> {
            let (parent, name) = self.resolve_parent(path)?;
            let made =
                self.mknod(parent.ino(), name, f::S_IFREG | (o.mode & 0o7777), 0, &Creator::new(o.uid, o.gid))?;
            // Removed (and its number taken) before it could be held: as if it had
            // been removed right after this open.
            let (md, pin) =
                self.hold(&made)?.ok_or_else(|| Error::not_found("the new file was removed while it was opened"))?;
            Ok((md, pin, true))
        };
        let (md, pin, created) = if o.create_new {
            create()?
        } else {
            match self.pin(path, !o.nofollow) {
                Ok((md, pin)) => (md, pin, false),
                Err(e) if e.kind == ErrorKind::NotFound && o.create => match create() {
                    Ok(made) => made,
                    // Lost a race with another creator, or a dangling symlink.
                    Err(e2) if e2.kind == ErrorKind::Exists => match self.pin(path, !o.nofollow) {
                        Ok((md, pin)) => (md, pin, false),
                        Err(e3) if e3.kind == ErrorKind::NotFound && !o.nofollow => {
                            // As Linux: O_CREAT through a dangling symlink creates its
                            // target (O_EXCL does not follow: EEXIST above).
                            return self.create_through_link(path, o, depth);
                        }
                        Err(e3) => return Err(e3),
                    },
                    Err(e2) => return Err(e2),
                },
                Err(e) => return Err(e),
            }
        };
        let ino = md.ino;
        let file = File::new(self, ino, pin.into_cell(), o.read, writable, o.append);
        if md.kind == FileType::File {
            super::attrflags::deny_open(&file.cell.lock(), writable, o.append, o.truncate && !created)?;
        }
        match md.kind {
            // As may_open: O_TRUNC asks for write access, and O_CREAT of a name that
            // is a directory is EISDIR, whatever the access mode.
            FileType::Directory if writable || o.truncate || o.create => return Err(Error::is_dir("")),
            FileType::Symlink => return Err(Error::is_loop("O_NOFOLLOW on a symlink")),
            _ => {}
        }
        // POSIX: O_TRUNC updates mtime and ctime even on an empty file.
        if o.truncate && md.kind == FileType::File && !created {
            self.truncate(ino, 0)?;
        }
        Ok(file)
    }

    /// O_CREAT of `path`, a symlink whose target does not exist: open (and create)
    /// the target, relative to the link's directory.
    fn create_through_link(&self, path: &[u8], o: &OpenOptions, depth: u32) -> Result<File> {
        if depth >= MAX_SYMLINKS {
            return Err(Error::is_loop("too many levels of symbolic links"));
        }
        let (md, _pin) = self.pin(path, false)?;
        if md.kind != FileType::Symlink {
            // Made by another in the meantime: open what is there now.
            return self.open_following(path, o, depth + 1);
        }
        let target = self.readlink(md.ino)?;
        let full = if target.starts_with(b"/") {
            target
        } else {
            let (dir, _) = split_last(path)?;
            let mut full = if dir.is_empty() { Vec::new() } else { dir.to_vec() };
            full.extend_from_slice(&target);
            full
        };
        self.open_following(&full, o, depth + 1)
    }

    /// A handle on the open regular file `ino`, for a front end that checked the
    /// caller's access itself (the shim's daemon: the kernel did at open(2)). Holds the
    /// inode like an open file: its number is not reused while the handle lives.
    pub fn open_ino_file(&self, ino: u64, read: bool, write: bool, append: bool) -> Result<File> {
        self.inner.check_up()?;
        let (md, cell) = self.open_cell(ino)?;
        let file = File::new(self, ino, cell, read, write || append, append);
        if md.kind != FileType::File {
            return Err(Error::invalid(format!("inode {ino} is not a regular file")));
        }
        super::attrflags::deny_open(&file.cell.lock(), write || append, append, false)?;
        Ok(file)
    }

    pub fn create(&self, path: impl AsRef<[u8]>) -> Result<File> {
        OpenOptions::new().write(true).create(true).truncate(true).open(self, path)
    }

    pub fn metadata(&self, path: impl AsRef<[u8]>) -> Result<Metadata> {
        self.resolve_md(path.as_ref(), true)
    }

    pub fn symlink_metadata(&self, path: impl AsRef<[u8]>) -> Result<Metadata> {
        self.resolve_md(path.as_ref(), false)
    }

    pub fn create_dir(&self, path: impl AsRef<[u8]>, mode: u32) -> Result<Metadata> {
        let (parent, name) = self.resolve_parent(path.as_ref()).map_err(|e| busy_is(e, ErrorKind::Exists))?;
        self.mkdir(parent.ino(), name, mode, &Creator::new(0, 0))
    }

    pub fn remove_dir(&self, path: impl AsRef<[u8]>) -> Result<()> {
        let (parent, name) = self.resolve_parent(path.as_ref())?;
        self.rmdir(parent.ino(), name)
    }

    pub fn remove_file(&self, path: impl AsRef<[u8]>) -> Result<()> {
        let path = path.as_ref();
        if trailing_slash(path) {
            // "f/" is ENOTDIR (a directory is refused by unlink itself: EISDIR).
            self.must_be_dir(path)?;
        }
        let (parent, name) = self.resolve_parent(path).map_err(|e| busy_is(e, ErrorKind::IsDir))?;
        self.unlink(parent.ino(), name)
    }

    pub fn rename_path(&self, from: impl AsRef<[u8]>, to: impl AsRef<[u8]>) -> Result<()> {
        let (from, to) = (from.as_ref(), to.as_ref());
        if trailing_slash(from) || trailing_slash(to) {
            // As the kernel's do_renameat2: a slash on either name moves directories only.
            self.must_be_dir(from)?;
        }
        let (sp, sname) = self.resolve_parent(from)?;
        let (dp, dname) = self.resolve_parent(to)?;
        self.rename(sp.ino(), sname, dp.ino(), dname, false)
    }

    /// ENOTDIR unless the last name of `path` (not followed if a symlink) is a
    /// directory; ENOENT if it does not exist.
    fn must_be_dir(&self, path: &[u8]) -> Result<()> {
        match self.resolve_md(trim_slashes(path), false)? {
            md if md.is_dir() => Ok(()),
            _ => Err(Error::not_dir("a name ending in '/' that is not a directory")),
        }
    }

    /// A new name other than a directory's ending in '/': EEXIST if the name is
    /// taken, else ENOENT (the kernel's filename_create, which calls this asking for
    /// a directory that does not exist).
    fn refuse_new_name_with_slash(&self, path: &[u8]) -> Result<()> {
        if !trailing_slash(path) {
            return Ok(());
        }
        match self.resolve_md(trim_slashes(path), false) {
            Ok(_) => Err(Error::exists("")),
            Err(e) if e.kind == ErrorKind::NotFound => Err(Error::not_found("a new name ending in '/'")),
            Err(e) => Err(e),
        }
    }

    pub fn hard_link(&self, src: impl AsRef<[u8]>, dst: impl AsRef<[u8]>) -> Result<Metadata> {
        let (md, _pin) = self.pin(src.as_ref(), false)?;
        self.refuse_new_name_with_slash(dst.as_ref())?;
        let (parent, name) = self.resolve_parent(dst.as_ref()).map_err(|e| busy_is(e, ErrorKind::Exists))?;
        self.link(md.ino, parent.ino(), name)
    }

    /// Create `link` pointing at `target`.
    pub fn symlink_path(&self, target: impl AsRef<[u8]>, link: impl AsRef<[u8]>) -> Result<Metadata> {
        self.refuse_new_name_with_slash(link.as_ref())?;
        let (parent, name) = self.resolve_parent(link.as_ref()).map_err(|e| busy_is(e, ErrorKind::Exists))?;
        self.symlink(parent.ino(), name, target.as_ref(), &Creator::new(0, 0))
    }

    pub fn read_link(&self, path: impl AsRef<[u8]>) -> Result<Vec<u8>> {
        let (md, _pin) = self.pin(path.as_ref(), false)?;
        self.readlink(md.ino)
    }

    pub fn set_permissions(&self, path: impl AsRef<[u8]>, mode: u32) -> Result<Metadata> {
        let (md, _pin) = self.pin(path.as_ref(), true)?;
        self.setattr(md.ino, &SetAttr { mode: Some(mode), ..Default::default() })
    }

    pub fn set_owner(&self, path: impl AsRef<[u8]>, uid: Option<u32>, gid: Option<u32>) -> Result<Metadata> {
        let (md, _pin) = self.pin(path.as_ref(), true)?;
        self.setattr(md.ino, &SetAttr { uid, gid, ..Default::default() })
    }

    pub fn set_times(
        &self,
        path: impl AsRef<[u8]>,
        atime: Option<TimeSet>,
        mtime: Option<TimeSet>,
    ) -> Result<Metadata> {
        let (md, _pin) = self.pin(path.as_ref(), true)?;
        self.setattr(md.ino, &SetAttr { atime, mtime, ..Default::default() })
    }

    pub fn set_len(&self, path: impl AsRef<[u8]>, size: u64) -> Result<()> {
        let (md, _pin) = self.pin(path.as_ref(), true)?;
        self.truncate(md.ino, size)
    }

    /// Every entry of a directory except "." and "..", in offset order.
    pub fn read_dir(&self, path: impl AsRef<[u8]>) -> Result<Vec<DirEntry>> {
        let (md, _pin) = self.pin(path.as_ref(), true)?;
        let ino = md.ino;
        let mut out = Vec::new();
        let mut off = 2;
        loop {
            let batch = self.readdir(ino, off, 1024)?;
            let Some(last) = batch.last() else { break };
            off = last.next;
            out.extend(batch);
        }
        Ok(out)
    }

    pub fn write_file(&self, path: impl AsRef<[u8]>, data: &[u8]) -> Result<()> {
        self.create(path)?.write_all_at(data, 0)
    }

    pub fn read_file(&self, path: impl AsRef<[u8]>) -> Result<Vec<u8>> {
        let f = OpenOptions::new().read(true).open(self, path)?;
        // Grown as the data comes (a sparse file's size can pass memory): ENOMEM, not
        // an abort, when it does not fit.
        let size = f.metadata()?.size;
        let mut buf = vec![0; size.min(1 << 26) as usize + 1];
        let mut at = 0;
        loop {
            if at == buf.len() {
                buf.try_reserve(at).map_err(|_| Error::new(ErrorKind::NoMemory, "file larger than memory"))?;
                buf.resize(at * 2, 0);
            }
            let n = f.read_at(&mut buf[at..], at as u64)?;
            if n == 0 {
                break;
            }
            at += n;
        }
        buf.truncate(at);
        Ok(buf)
    }
}

/// Operations on "/" itself report what POSIX says for them, not EBUSY.
fn busy_is(e: Error, kind: ErrorKind) -> Error {
    if e.kind == ErrorKind::Busy {
        Error::new(kind, e.detail)
    } else {
        e
    }
}
