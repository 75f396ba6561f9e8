//! Inode-level operations: what a FUSE front end calls, and what the path API is
//! built on. Permissions are not checked here (the kernel does it for FUSE with
//! `default_permissions`; embedders are trusted); atime is updated on read only
//! with `Config::atime` (the relatime rule; noatime otherwise). See docs/DECISIONS.md.

use super::api::{DirEntry, FileType, Metadata, PrivChange, SetAttr, StatFs, TimeSet};
use super::attrflags::{deny_change, deny_immutable, deny_write};
use super::inode::{Inode, InodeCell};
use super::meta::{ftype_of, now, Meta, Place, TxSize};
use super::perm::{self, Acl, Creator};
use super::{Fs, FsInner};
use crate::aios::Trace;
use crate::cache::{Page, PageData, PageState};
use crate::commit::{entry_cost, Need};
use crate::config::Stack;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self as f, BLOCK, BLOCK_SIZE};
use crate::lock::ReadGuard;
use crate::nbw::StartedFetch;
use crate::readahead::RaState;
use std::io::IoSlice;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Pages a write reserves space for (unmapped, not reserved yet) and pages whose
/// unwritten blocks write-back will mark written (room for the split runs).
type Needs = (Vec<u64>, Vec<u64>);

/// An inode's extended attributes, (name, value) in name order.
type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// What a read's first look at its range found (`Fs::read_prepare`).
enum Prepared {
    /// Nothing to read: at or past the end of file, or no bytes asked for.
    Nothing,
    /// The pages of the range, and its length cut at the end of file.
    Pages(Vec<Arc<Page>>, usize),
    /// The pages of the range, some of them not readable yet (Fetching): put in the
    /// cache just now for the caller to read from the device, or on their way for
    /// another thread.
    Misses(Vec<Arc<Page>>, Misses),
}

/// What a read waits for, without the file's lock, before it copies.
enum Misses {
    /// Submitted (the asynchronous stack): `FsInner::finish_fetch`.
    Started(StartedFetch),
    /// Not yet (the synchronous stack, a large read): `FsInner::fetch`.
    Fetch(Vec<Arc<Page>>),
    /// Pages in another thread's fetch: waited for (`Page::wait`).
    Busy(Vec<Arc<Page>>),
}

/// ext4's limit; beyond it link() and mkdir() fail with EMLINK.
pub const LINK_MAX: u32 = 65000;

/// What a new inode is: type and permissions (before the umask, its directory's
/// default ACL and set-group-ID rules), creator, device number, symlink target.
struct NewNode<'a> {
    mode: u32,
    who: &'a Creator,
    rdev: u32,
    target: Option<&'a [u8]>,
}

pub(crate) fn check_name(name: &[u8]) -> Result<()> {
    if name.is_empty() {
        return Err(Error::not_found("empty name"));
    }
    if name.len() > f::NAME_MAX {
        return Err(Error::name_too_long(format!("name of {} bytes (at most {})", name.len(), f::NAME_MAX)));
    }
    if name.contains(&b'/') || name.contains(&0) {
        return Err(Error::invalid("name contains '/' or NUL"));
    }
    Ok(())
}

/// The most bytes of attribute names one listxattr returns (Linux's XATTR_LIST_MAX).
const XATTR_LIST_MAX: usize = 65536;

/// How many times a lookup looks again for a name whose inode went away under it.
const LOOKUP_TRIES: u32 = 64;

fn is_dot(name: &[u8]) -> bool {
    name == b"." || name == b".."
}

pub(crate) fn attr(ino: u64, node: &Inode) -> Metadata {
    let d = &node.d;
    Metadata {
        ino,
        kind: FileType::from_mode(d.mode),
        mode: d.mode,
        uid: d.uid,
        gid: d.gid,
        nlink: d.nlink,
        size: d.size,
        // Blocks written but not yet allocated (delayed allocation) count, as on ext4.
        blocks: (node.data_blocks() + node.chain.len() as u64 + node.xattr_blocks + node.reserved.len() as u64)
            * (BLOCK / 512),
        atime: d.atime,
        mtime: d.mtime,
        ctime: d.ctime,
        generation: d.generation,
        rdev: d.rdev,
        blksize: BLOCK_SIZE as u32,
    }
}

impl Fs {
    fn meta(&self) -> parking_lot::MutexGuard<'_, Meta> {
        self.inner.meta.lock()
    }

    /// Attributes, from the inode alone (no metadata lock once it is in memory).
    pub fn getattr(&self, ino: u64) -> Result<Metadata> {
        self.inner.check_up()?;
        let cell = self.inner.cell(ino)?;
        let node = cell.lock();
        if node.freed {
            return Err(Error::not_found(format!("inode {ino} is not in use")));
        }
        Ok(attr(ino, &node))
    }

    /// The inode `name` names in `parent`, and its attributes. The name is found, then
    /// its inode read; a rename over the name or an unlink in between can free that
    /// inode (and hand its number to a new one), so the answer is checked against the
    /// index again and the lookup repeated: a name that exists all along is always
    /// found, with its own inode's attributes (as the kernel's dentry lock assures).
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Metadata> {
        self.inner.check_up()?;
        let mut tries = 0;
        loop {
            let (ino, seen) = self.lookup_ino(parent, name)?;
            let got = self.getattr(ino);
            if tries < LOOKUP_TRIES && !is_dot(name) {
                // Found again, the name must still lead to this number (a name removed
                // meanwhile and its number taken by a new file would otherwise answer
                // with that file); an index no longer in memory is taken at its word.
                // No name of the directory was taken away since the index was read
                // (`InodeCell::names_gen`): it still leads there, and the index is not
                // locked again (all threads walking paths share the root's).
                let moved = match &got {
                    Err(e) => e.kind == ErrorKind::NotFound,
                    Ok(_) if seen.is_some() && seen == self.names_gen(parent) => false,
                    Ok(_) => match self.lookup_cached(parent, name) {
                        Ok(Some((now, _))) => now != ino,
                        Ok(None) => false,
                        Err(_) => true,
                    },
                };
                if moved {
                    tries += 1;
                    continue;
                }
            }
            return got;
        }
    }

    /// The inode `name` names in `parent`, and the directory's `names_gen` when the
    /// answer came from its index in memory.
    fn lookup_ino(&self, parent: u64, name: &[u8]) -> Result<(u64, Option<u64>)> {
        if let Some((ino, gen)) = self.lookup_cached(parent, name)? {
            return Ok((ino, Some(gen)));
        }
        let ino = {
            let mut m = self.meta();
            let dotdot = m.dir_parent(parent)?;
            match name {
                b"." => parent,
                b".." => dotdot,
                _ => {
                    check_name(name)?;
                    m.lookup(parent, name)?.ok_or_else(|| Error::not_found(""))?.0
                }
            }
        };
        Ok((ino, None))
    }

    /// Directory `dir`'s count of names taken away (`InodeCell::names_gen`), if it is
    /// in memory.
    fn names_gen(&self, dir: u64) -> Option<u64> {
        let gen = |cell: &InodeCell| {
            // A number that now belongs to a file (the directory removed and its
            // number reused) has no count: the lookup checks the name again.
            cell.names.as_ref().map(|_| cell.names_gen.load(std::sync::atomic::Ordering::Acquire))
        };
        self.inner.inodes.with(dir, gen).flatten()
    }

    /// A lookup answered without the metadata lock, from the directory's name index when
    /// the directory and its index are in memory (an index is complete, so a name not in
    /// it is not there), with the directory's `names_gen` as read under the index's lock.
    /// `Ok(None)`: not in memory, take the metadata lock.
    fn lookup_cached(&self, parent: u64, name: &[u8]) -> Result<Option<(u64, u64)>> {
        let found = self.inner.inodes.with(parent, |cell| {
            let Some(names) = &cell.names else {
                return Err(Error::not_dir(""));
            };
            let gen = || cell.names_gen.load(std::sync::atomic::Ordering::Acquire);
            match name {
                b"." => return Ok(Some((parent, gen()))),
                b".." => return Ok(Some((cell.lock().d.parent, gen()))),
                _ => check_name(name)?,
            }
            let names = names.read();
            match names.as_ref() {
                None => Ok(None),
                Some(idx) => {
                    idx.names.get(name).map(|(_, ino)| Some((*ino, gen()))).ok_or_else(|| Error::not_found(""))
                }
            }
        });
        found.unwrap_or(Ok(None))
    }

    /// `parent` can take a new inode: a directory, not removed, not immutable. Returns
    /// its mode, group and link count.
    fn live_dir(m: &mut Meta, parent: u64) -> Result<(u32, u32, u32)> {
        m.peek(parent, |p| {
            if !p.is_dir() {
                return Err(Error::not_dir(""));
            }
            if p.d.nlink == 0 {
                return Err(Error::not_found("directory was removed"));
            }
            deny_immutable(p)?;
            Ok((p.d.mode, p.d.gid, p.d.nlink))
        })?
    }

    /// `name` can be added to `parent`: a valid name, in a live directory (`live_dir`,
    /// whose answer it returns), not taken.
    fn check_new_name(m: &mut Meta, parent: u64, name: &[u8]) -> Result<(u32, u32, u32)> {
        check_name(name)?;
        let dir = Self::live_dir(m, parent)?;
        if is_dot(name) || m.lookup(parent, name)?.is_some() {
            return Err(Error::exists(""));
        }
        Ok(dir)
    }

    /// `target` may go away in place of (rename) or as (rmdir/unlink) something that is
    /// a directory iff `dir`: same kind, and an empty directory. Returns whether it is one.
    fn check_replaceable(m: &mut Meta, dir: bool, target: u64) -> Result<bool> {
        let is_dir = m.peek(target, |n| n.is_dir())?;
        match (dir, is_dir) {
            (false, true) => Err(Error::is_dir("")),
            (true, false) => Err(Error::not_dir("")),
            (true, true) if !m.dir_is_empty(target)? => Err(Error::not_empty("")),
            _ => Ok(is_dir),
        }
    }

    /// Create a regular file, special file, directory or symlink.
    fn make(&self, parent: u64, name: &[u8], new: NewNode<'_>) -> Result<Metadata> {
        let NewNode { mode, who, rdev, target } = new;
        self.inner.check_writable()?;
        let is_dir = mode & f::S_IFMT == f::S_IFDIR;
        let long_target = target.is_some_and(|t| t.len() > f::INLINE_MAX);
        // Made before the metadata lock (an allocation, and the file lock's per-CPU
        // shards): its mode is set once the checks under the lock have settled it.
        let mut cell = InodeCell::blank(0);
        let (mut m, (mode, gid, xattrs)) = self.inner.admitted(|m| {
            let (dir_mode, dir_gid, dir_nlink) = Self::check_new_name(m, parent, name)?;
            if is_dir && dir_nlink >= LINK_MAX {
                return Err(Error::too_many_links(""));
            }
            let (mode, gid, xattrs) = Self::new_mode(m, parent, dir_mode, dir_gid, mode, who)?;
            let grow = m.dir(parent, |idx| idx.free.is_empty())?;
            // The parent, the new inode and its bitmap block, the entry, a long
            // symlink's block and its bitmap block, the blocks of inherited ACLs and
            // their bitmap blocks.
            let extra = long_target as u64 + Self::inherited_blocks(&xattrs)?;
            let tx = m.inode_cost(parent, grow as u64)?.plus(TxSize::new(2 + 2 * extra, 0));
            let blocks = grow as u64 + extra;
            Ok((Need::new(tx.plus(entry_cost(grow)), blocks, true), (mode, gid, xattrs)))
        })?;
        std::sync::Arc::get_mut(&mut cell).expect("a blank cell is not shared").set_mode(mode);
        let ino = self.inner.mutate(&mut m, |m| {
            let place = if is_dir { Place::NewGroup } else { Place::Near(parent) };
            let ino = m.new_inode(cell, who.uid, gid, place)?;
            let payload = match target {
                Some(t) if t.len() > f::INLINE_MAX => Some(m.write_payload_block(t)?),
                _ => None,
            };
            // As ext4 (EXT4_FL_INHERITED): a directory's noatime flag passes to what
            // is made in it.
            let inherited = m.peek(parent, |p| p.d.flags & f::INODE_FLAG_NOATIME)?;
            let mut node = m.inode(ino)?;
            node.d.flags |= inherited;
            node.d.nlink = if is_dir { 2 } else { 1 };
            // Its fdatasync commits (ext4 records the creating transaction for it):
            // a new file's name is what makes its data reachable.
            node.data_meta_dirty = true;
            node.d.rdev = rdev;
            if is_dir {
                node.d.parent = parent;
            }
            if let Some(t) = target {
                node.d.size = t.len() as u64;
                match payload {
                    Some(b) => node.add_mapping(0, b, 1),
                    None => {
                        node.d.flags |= f::INODE_FLAG_INLINE;
                        node.d.inline = t.to_vec();
                    }
                }
            }
            node.register(&m.tx, None);
            drop(node);
            if !xattrs.is_empty() {
                m.set_xattrs(ino, xattrs)?;
            }
            m.dir_add(parent, name, ino, ftype_of(mode))?;
            let t = now();
            m.update(parent, |p| {
                p.d.mtime = t;
                p.d.ctime = t;
                if is_dir {
                    p.d.nlink += 1;
                }
            })?;
            Ok(ino)
        })?;
        let md = m.peek(ino, |n| attr(ino, n))?;
        drop(m);
        self.inner.maybe_commit();
        Ok(md)
    }

    /// Mode, group and extended attributes of a new inode in `parent` (of `dir_mode`
    /// and `dir_gid`), as a local file system gets them from the kernel: the
    /// set-group-ID directory rules (`perm::new_owner`), then the directory's default
    /// ACL (`posix_acl_create`: the new inode's access ACL, and a directory's default
    /// ACL; the umask does not apply) or, without one, the umask. A symlink is 0777.
    fn new_mode(
        m: &mut Meta,
        parent: u64,
        dir_mode: u32,
        dir_gid: u32,
        mode: u32,
        who: &Creator,
    ) -> Result<(u32, u32, Xattrs)> {
        let (mut mode, gid) = perm::new_owner(dir_mode, dir_gid, mode, who);
        let mut xattrs = Vec::new();
        if mode & f::S_IFMT == f::S_IFLNK {
            return Ok((mode, gid, xattrs));
        }
        let default = m.xattrs(parent)?.into_iter().find(|(n, _)| n == perm::ACL_DEFAULT);
        let default = match default {
            Some((_, v)) => Acl::decode(&v)?,
            None => None,
        };
        match default {
            None => mode &= !(who.umask & 0o777),
            Some(acl) => {
                let (access, masked) = acl.inherit(mode);
                mode = masked;
                if !access.is_mode() {
                    xattrs.push((perm::ACL_ACCESS.to_vec(), access.encode()));
                }
                if mode & f::S_IFMT == f::S_IFDIR {
                    xattrs.push((perm::ACL_DEFAULT.to_vec(), acl.encode()));
                }
                xattrs.sort();
            }
        }
        Ok((mode, gid, xattrs))
    }

    /// mknod(2) for regular and special files (mode carries the type; 0 means regular).
    pub fn mknod(&self, parent: u64, name: &[u8], mode: u32, rdev: u32, who: &Creator) -> Result<Metadata> {
        let mode = if mode & f::S_IFMT == 0 { mode | f::S_IFREG } else { mode };
        match mode & f::S_IFMT {
            f::S_IFREG | f::S_IFIFO | f::S_IFCHR | f::S_IFBLK | f::S_IFSOCK => {}
            // As the kernel's may_mknod.
            f::S_IFDIR => return Err(Error::not_permitted("mknod of a directory")),
            _ => return Err(Error::invalid("mknod of a symlink or an unknown type")),
        }
        self.make(parent, name, NewNode { mode: mode & (f::S_IFMT | 0o7777), who, rdev, target: None })
    }

    /// Blocks the attributes a new inode inherits (default ACLs) take.
    fn inherited_blocks(xattrs: &[(Vec<u8>, Vec<u8>)]) -> Result<u64> {
        if xattrs.is_empty() {
            return Ok(0);
        }
        f::xattr_blocks_for(xattrs)
            .map(|n| n as u64)
            .ok_or_else(|| Error::no_space("inherited ACLs larger than an inode's attributes"))
    }

    /// open(2) with O_TMPFILE: a regular file in `parent`'s file system with no name,
    /// returned open (`release_ino` closes it). It is freed at its last release, or at
    /// the next mount after a crash, unless `link` gives it a name first, which it may
    /// unless `linkable` is false (O_EXCL). Mode and group follow the same rules as a
    /// create in `parent`.
    pub fn tmpfile(&self, parent: u64, mode: u32, who: &Creator, linkable: bool) -> Result<Metadata> {
        self.inner.check_writable()?;
        let mode = f::S_IFREG | (mode & 0o7777);
        let mut cell = InodeCell::blank(0);
        let (mut m, (mode, gid, xattrs)) = self.inner.admitted(|m| {
            let (dir_mode, dir_gid, _) = Self::live_dir(m, parent)?;
            let (mode, gid, xattrs) = Self::new_mode(m, parent, dir_mode, dir_gid, mode, who)?;
            // The new inode and its bitmap block, the blocks of inherited ACLs and their
            // bitmap blocks.
            let extra = Self::inherited_blocks(&xattrs)?;
            Ok((Need::new(TxSize::new(2 + 2 * extra, 0), extra, true), (mode, gid, xattrs)))
        })?;
        std::sync::Arc::get_mut(&mut cell).expect("a blank cell is not shared").set_mode(mode);
        let ino = self.inner.mutate(&mut m, |m| {
            let ino = m.new_inode(cell, who.uid, gid, Place::Near(parent))?;
            let mut node = m.inode(ino)?;
            node.d.nlink = 0;
            node.linkable = linkable;
            node.register(&m.tx, None);
            drop(node);
            if !xattrs.is_empty() {
                m.set_xattrs(ino, xattrs)?;
            }
            // Open before the metadata lock goes: nothing frees it until it is released.
            m.cell(ino)?.opens.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            Ok(ino)
        })?;
        let md = attr(ino, &*m.inode(ino)?);
        drop(m);
        self.inner.maybe_commit();
        Ok(md)
    }

    pub fn mkdir(&self, parent: u64, name: &[u8], mode: u32, who: &Creator) -> Result<Metadata> {
        // As the kernel's vfs_mkdir: set-user-ID and set-group-ID are not the
        // caller's to ask for (a directory gets set-group-ID from its parent only).
        self.make(parent, name, NewNode { mode: f::S_IFDIR | (mode & 0o1777), who, rdev: 0, target: None })
    }

    pub fn symlink(&self, parent: u64, name: &[u8], target: &[u8], who: &Creator) -> Result<Metadata> {
        if target.is_empty() {
            return Err(Error::not_found("empty symlink target"));
        }
        if target.len() > f::SYMLINK_MAX {
            return Err(Error::name_too_long("symlink target longer than PATH_MAX"));
        }
        self.make(parent, name, NewNode { mode: f::S_IFLNK | 0o777, who, rdev: 0, target: Some(target) })
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        self.inner.check_up()?;
        let mut m = self.meta();
        let node = m.inode(ino)?;
        if node.kind() != f::S_IFLNK {
            return Err(Error::invalid("not a symlink"));
        }
        if node.d.flags & f::INODE_FLAG_INLINE != 0 {
            return Ok(node.d.inline.clone());
        }
        let (len, b) = (node.d.size as usize, node.map(0).ok_or_else(|| Error::corrupt("symlink without a block"))?);
        drop(node);
        if len > f::SYMLINK_MAX {
            return Err(Error::corrupt("symlink target too long"));
        }
        m.read_payload_block(b, len)
    }

    pub fn link(&self, ino: u64, parent: u64, name: &[u8]) -> Result<Metadata> {
        self.inner.check_writable()?;
        let (mut m, mode) = self.inner.admitted(|m| {
            Self::check_new_name(m, parent, name)?;
            let node = m.inode(ino)?;
            if node.is_dir() {
                return Err(Error::not_permitted("hard link to a directory"));
            }
            if node.d.nlink >= LINK_MAX {
                return Err(Error::too_many_links(""));
            }
            if node.d.nlink == 0 && !node.linkable {
                return Err(Error::not_found("file was removed"));
            }
            // Nameless and with no handle left, it is deleted (see `open_cell`).
            if node.d.nlink == 0 && m.cell(ino)?.opens.load(std::sync::atomic::Ordering::Acquire) == 0 {
                return Err(Error::not_found("file was deleted"));
            }
            deny_change(&node)?;
            let mode = node.d.mode;
            drop(node);
            let grow = m.dir(parent, |idx| idx.free.is_empty())?;
            let tx = m.inode_cost(parent, grow as u64)?.plus(m.inode_cost(ino, 0)?).plus(entry_cost(grow));
            Ok((Need::new(tx, grow as u64, false), mode))
        })?;
        self.inner.mutate(&mut m, |m| {
            m.dir_add(parent, name, ino, ftype_of(mode))?;
            let t = now();
            m.update(ino, |node| {
                node.d.nlink += 1;
                node.linkable = false;
                node.d.ctime = t;
            })?;
            m.update(parent, |p| {
                p.d.mtime = t;
                p.d.ctime = t;
            })
        })?;
        let md = attr(ino, &*m.inode(ino)?);
        drop(m);
        self.inner.maybe_commit();
        Ok(md)
    }

    /// Drop one link of `ino`; free it once no name and no handle is left.
    /// Returns the inode's cell if that was its last name and no handle holds it: the
    /// caller frees it (`FsInner::free_now`) once the metadata lock is dropped; until
    /// then it is listed for the next commit to free.
    fn drop_link(m: &mut Meta, ino: u64, is_dir: bool) -> Result<Option<std::sync::Arc<InodeCell>>> {
        let gone = m.update(ino, |node| {
            node.d.nlink = if is_dir { 0 } else { node.d.nlink.saturating_sub(1) };
            node.d.ctime = now();
            node.d.nlink == 0
        })?;
        let cell = m.cell(ino)?;
        if gone && cell.opens.load(std::sync::atomic::Ordering::Acquire) == 0 {
            m.to_free.insert(ino);
            return Ok(Some(cell));
        }
        Ok(None)
    }

    /// Directory `dir` lost a subdirectory (its `..` no longer links it). A live
    /// directory keeps its own two links (its name and `.`): a damaged image's count
    /// of 2 or less with subdirectories is not taken lower (to 0 it would be freed as
    /// an orphan while still named, and a root at 0 no longer mounts); fsck reports it.
    fn lose_subdir(m: &mut Meta, dir: u64) -> Result<()> {
        Self::drop_subdir_link(&mut m.inode(dir)?.d, dir);
        Ok(())
    }

    fn drop_subdir_link(d: &mut f::DiskInode, dir: u64) {
        if d.nlink > 2 {
            d.nlink -= 1;
        } else {
            tracing::warn!("directory {dir} lost a subdirectory with {} links: its link count is damaged", d.nlink);
        }
    }

    /// Free an inode whose last name a change just removed. The change is done and
    /// must be reported as done: if freeing fails (no room now, or an error that
    /// poisons the file system and is reported by the next call), the inode stays
    /// listed for the commit to free.
    fn free_after_change(&self, cell: &InodeCell) {
        if let Err(e) = self.inner.free_now(cell) {
            tracing::warn!("inode {}: freeing after its last name went failed: {e}", cell.ino);
        }
    }

    pub fn unlink(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.remove(parent, name, false)
    }

    pub fn rmdir(&self, parent: u64, name: &[u8]) -> Result<()> {
        self.remove(parent, name, true)
    }

    fn remove(&self, parent: u64, name: &[u8], dir: bool) -> Result<()> {
        self.inner.check_writable()?;
        match name {
            b"." if dir => return Err(Error::invalid("cannot remove '.'")),
            b".." if dir => return Err(Error::not_empty("cannot remove '..'")),
            b"." | b".." => return Err(Error::is_dir("cannot unlink '.' or '..'")),
            _ => check_name(name)?,
        }
        let share = self.inner.tx_room() / 4;
        // The access lock of the inode the name leads to now, tried before the
        // metadata lock (the lock order's way round; never waited for): freeing the
        // inode under the metadata lock then locks nothing more there. If the name
        // leads elsewhere by then, it is tried there as before.
        let early = self.lookup_cached(parent, name).ok().flatten().and_then(|(ino, _)| self.inner.inodes.get(ino));
        let early_io = early.as_ref().and_then(|c| c.io.try_write());
        let (mut m, (ino, is_dir, free)) = self.inner.admitted(|m| {
            // The parent's flags are checked once the name is found (ENOENT first).
            let parent_change =
                m.peek(parent, |p| if p.is_dir() { Ok(deny_change(p)) } else { Err(Error::not_dir("")) })??;
            let (ino, _) = m.lookup(parent, name)?.ok_or_else(|| Error::not_found(""))?;
            // The flags first, then kind and emptiness, as Linux's may_delete: an
            // append-only parent or an immutable directory is EPERM even when full.
            parent_change?;
            m.peek(ino, deny_change)??;
            let is_dir = Self::check_replaceable(m, dir, ino)?;
            let tx = m.inode_cost(parent, 0)?.plus(m.inode_cost(ino, 0)?).plus(entry_cost(false));
            // The last name of an inode nobody has open, which has no pages in the
            // cache: it is freed in this same change (one lock, one admission), as
            // long as freeing it is small.
            let cell = m.cell(ino)?;
            let last = is_dir || cell.lock().d.nlink == 1;
            if last && cell.opens.load(std::sync::atomic::Ordering::Acquire) == 0 && cell.pages_end() == 0 {
                let cost = m.free_cost(ino)?;
                if cost.log_blocks() <= share {
                    return Ok((Need::tx(tx.plus(cost)), (ino, is_dir, true)));
                }
            }
            Ok((Need::tx(tx), (ino, is_dir, false)))
        })?;
        // A cell freed here is dropped (deallocated) after the metadata lock.
        let mut freed_cell = None;
        let gone = self.inner.mutate(&mut m, |m| {
            m.dir_remove(parent, name)?;
            let t = now();
            m.update(parent, |p| {
                p.d.mtime = t;
                p.d.ctime = t;
                if is_dir {
                    Self::drop_subdir_link(&mut p.d, parent);
                }
            })?;
            if free {
                let cell = m.cell(ino)?;
                // No reader may be inside the file while it is freed (`free_now`):
                // without waiting, under the metadata lock, or it is left to
                // `free_now` (through `drop_link`). The open count is read under the
                // inode's lock, as `open_cell` changes it: one of the two sees the other.
                let held = early_io.is_some() && early.as_ref().is_some_and(|c| std::sync::Arc::ptr_eq(c, &cell));
                let io = if held { None } else { cell.io.try_write() };
                let freed = if held || io.is_some() {
                    let mut node = cell.lock();
                    let last = is_dir || node.d.nlink == 1;
                    let opens = cell.opens.load(std::sync::atomic::Ordering::Acquire);
                    let now = last && opens == 0 && cell.pages_end() == 0;
                    if now {
                        node.d.nlink = 0;
                        node.freed = true;
                        drop(node);
                        self.inner.free_inode(m, ino)?;
                    }
                    now
                } else {
                    false
                };
                drop(io);
                if freed {
                    freed_cell = Some(cell);
                    return Ok(None);
                }
            }
            Self::drop_link(m, ino, is_dir)
        })?;
        drop(m);
        // Before `free_after_change`, which may take this lock to free the inode.
        drop(early_io);
        drop(freed_cell);
        if let Some(cell) = gone {
            self.free_after_change(&cell);
        }
        self.inner.maybe_commit();
        Ok(())
    }

    /// rename(2). `noreplace` is RENAME_NOREPLACE.
    pub fn rename(&self, sp: u64, sname: &[u8], dp: u64, dname: &[u8], noreplace: bool) -> Result<()> {
        self.rename_inner(sp, sname, dp, dname, noreplace, None)
    }

    /// renameat2(2) with RENAME_WHITEOUT: the rename, and in the same transaction a
    /// whiteout (a character device 0:0, owned by `owner`, uid and gid) takes the source's name,
    /// as overlayfs needs. (The kernel checks CAP_MKNOD.)
    pub fn rename_whiteout(
        &self,
        sp: u64,
        sname: &[u8],
        dp: u64,
        dname: &[u8],
        noreplace: bool,
        owner: (u32, u32),
    ) -> Result<()> {
        self.rename_inner(sp, sname, dp, dname, noreplace, Some(owner))
    }

    /// The checks every rename starts with: a writable file system, names that can be
    /// renamed ("." and ".." are EBUSY).
    /// As the kernel's `do_renameat2`: a "." or ".." target with RENAME_NOREPLACE
    /// is EEXIST (after a dot source's EBUSY).
    fn check_rename_names(&self, sname: &[u8], dname: &[u8], noreplace: bool) -> Result<()> {
        self.inner.check_writable()?;
        if !is_dot(sname) && is_dot(dname) && noreplace {
            return Err(Error::exists("RENAME_NOREPLACE onto '.' or '..'"));
        }
        if is_dot(sname) || is_dot(dname) {
            return Err(Error::new(crate::ErrorKind::Busy, "cannot rename '.' or '..'"));
        }
        check_name(sname)?;
        check_name(dname)
    }

    /// EINVAL if directory `into` is directory `moved` or inside it (a rename would
    /// detach `moved`'s subtree).
    fn check_not_inside(m: &mut Meta, moved: u64, into: u64) -> Result<()> {
        if Self::is_inside(m, into, moved)? {
            return Err(Error::invalid("cannot move a directory into itself"));
        }
        Ok(())
    }

    /// Whether directory `at` is directory `dir` or inside it.
    fn is_inside(m: &mut Meta, mut at: u64, dir: u64) -> Result<bool> {
        let from = at;
        // A damaged image can hold a loop of parents: no chain is longer than the
        // number of inodes.
        let mut steps = 0u64;
        while at != dir {
            if at == f::ROOT_INO {
                return Ok(false);
            }
            steps += 1;
            if steps > m.sb.inode_count {
                return Err(Error::corrupt(format!("directory {from}: its parents form a loop")));
            }
            at = m.inode(at)?.d.parent;
        }
        Ok(true)
    }

    /// renameat2(2) with RENAME_EXCHANGE: the two names swap their inodes atomically.
    /// Both must exist (ENOENT); a directory may not move into itself (EINVAL).
    pub fn rename_exchange(&self, sp: u64, sname: &[u8], dp: u64, dname: &[u8]) -> Result<()> {
        self.check_rename_names(sname, dname, false)?;
        let (mut m, checked) = self.inner.admitted(|m| {
            if !m.inode(sp)?.is_dir() || !m.inode(dp)?.is_dir() {
                return Err(Error::not_dir(""));
            }
            let (a, _) = m.lookup(sp, sname)?.ok_or_else(|| Error::not_found(""))?;
            let (b, _) = m.lookup(dp, dname)?.ok_or_else(|| Error::not_found(""))?;
            if a == b {
                return Ok((Need::tx(TxSize::default()), None));
            }
            let (a_mode, b_mode) = (m.inode(a)?.d.mode, m.inode(b)?.d.mode);
            for ino in [a, b, sp, dp] {
                deny_change(&*m.inode(ino)?)?;
            }
            let is_dir = |mode: u32| mode & f::S_IFMT == f::S_IFDIR;
            // Neither directory may end up inside itself.
            for (moved, into) in [(a, dp), (b, sp)] {
                if m.inode(moved)?.is_dir() {
                    Self::check_not_inside(m, moved, into)?;
                }
            }
            // A directory moving into the other parent gives it a link (EMLINK at the
            // limit, as rename; a damaged count near 2^32 must not wrap).
            if sp != dp {
                for (moved, into) in [(a_mode, dp), (b_mode, sp)] {
                    if is_dir(moved) && m.inode(into)?.d.nlink >= LINK_MAX {
                        return Err(Error::too_many_links(""));
                    }
                }
            }
            let tx = m
                .inode_cost(sp, 0)?
                .plus(m.inode_cost(dp, 0)?)
                .plus(m.inode_cost(a, 0)?)
                .plus(m.inode_cost(b, 0)?)
                .plus(entry_cost(false))
                .plus(entry_cost(false));
            Ok((Need::tx(tx), Some((a, a_mode, is_dir(a_mode), b, b_mode, is_dir(b_mode)))))
        })?;
        let Some((a, a_mode, a_dir, b, b_mode, b_dir)) = checked else {
            return Ok(());
        };
        self.inner.mutate(&mut m, |m| {
            let t = now();
            m.dir_replace(dp, dname, a, ftype_of(a_mode))?;
            m.dir_replace(sp, sname, b, ftype_of(b_mode))?;
            if sp != dp {
                if a_dir {
                    m.inode(a)?.d.parent = dp;
                    Self::lose_subdir(m, sp)?;
                    m.inode(dp)?.d.nlink += 1;
                }
                if b_dir {
                    m.inode(b)?.d.parent = sp;
                    Self::lose_subdir(m, dp)?;
                    m.inode(sp)?.d.nlink += 1;
                }
            }
            for ino in [sp, dp] {
                m.update(ino, |n| {
                    n.d.mtime = t;
                    n.d.ctime = t;
                })?;
            }
            for ino in [a, b] {
                m.update(ino, |n| n.d.ctime = t)?;
            }
            Ok(())
        })?;
        drop(m);
        self.inner.maybe_commit();
        Ok(())
    }

    fn rename_inner(
        &self,
        sp: u64,
        sname: &[u8],
        dp: u64,
        dname: &[u8],
        noreplace: bool,
        whiteout: Option<(u32, u32)>,
    ) -> Result<()> {
        self.check_rename_names(sname, dname, noreplace)?;
        let (mut m, checked) = self.inner.admitted(|m| {
            if !m.inode(sp)?.is_dir() || !m.inode(dp)?.is_dir() {
                return Err(Error::not_dir(""));
            }
            if m.inode(dp)?.d.nlink == 0 {
                return Err(Error::not_found("target directory was removed"));
            }
            let (src, _) = m.lookup(sp, sname)?.ok_or_else(|| Error::not_found(""))?;
            let src_mode = m.inode(src)?.d.mode;
            deny_change(&*m.inode(src)?)?;
            deny_change(&*m.inode(sp)?)?;
            deny_immutable(&*m.inode(dp)?)?;
            let src_dir = src_mode & f::S_IFMT == f::S_IFDIR;
            let dst = m.lookup(dp, dname)?.map(|(i, _)| i);
            if dst == Some(src) {
                return if noreplace { Err(Error::exists("")) } else { Ok((Need::tx(TxSize::default()), None)) };
            }
            if src_dir {
                Self::check_not_inside(m, src, dp)?;
                if sp != dp && m.inode(dp)?.d.nlink >= LINK_MAX && dst.is_none() {
                    return Err(Error::too_many_links(""));
                }
            }
            let grow = match dst {
                Some(d) => {
                    if noreplace {
                        return Err(Error::exists(""));
                    }
                    // Replacing an entry removes one: not in an append-only directory
                    // (the kernel's may_delete, which it cannot check for us).
                    deny_change(&*m.inode(dp)?)?;
                    // The kernel's "trap": a target that holds the source's own
                    // directory is not empty, whatever the source is.
                    if !src_dir && m.inode(d)?.is_dir() && Self::is_inside(m, sp, d)? {
                        return Err(Error::not_empty("the target holds the source"));
                    }
                    // The flags before kind and emptiness, as rmdir (may_delete).
                    deny_change(&*m.inode(d)?)?;
                    Self::check_replaceable(m, src_dir, d)?;
                    false
                }
                None => m.dir(dp, |idx| idx.free.is_empty())?,
            };
            let mut tx = m.inode_cost(sp, 0)?.plus(m.inode_cost(dp, grow as u64)?).plus(m.inode_cost(src, 0)?);
            if let Some(d) = dst {
                tx = tx.plus(m.inode_cost(d, 0)?);
            }
            // The source entry's block and the target's.
            tx = tx.plus(entry_cost(false)).plus(entry_cost(grow));
            if whiteout.is_some() {
                // The whiteout's inode and its bitmap block (its entry takes the
                // source's slot).
                tx = tx.plus(TxSize::new(2, 0));
            }
            let need = Need::new(tx, grow as u64, whiteout.is_some());
            Ok((need, Some((src, src_mode, src_dir, dst))))
        })?;
        let Some((src, src_mode, src_dir, dst)) = checked else {
            return Ok(());
        };
        let white_cell = whiteout.map(|_| InodeCell::blank(f::S_IFCHR));
        let gone = self.inner.mutate(&mut m, |m| {
            let t = now();
            let mut gone = None;
            match dst {
                Some(d) => {
                    m.dir_replace(dp, dname, src, ftype_of(src_mode))?;
                    let d_dir = m.inode(d)?.is_dir();
                    if d_dir {
                        Self::lose_subdir(m, dp)?;
                    }
                    gone = Self::drop_link(m, d, d_dir)?;
                }
                None => m.dir_add(dp, dname, src, ftype_of(src_mode))?,
            }
            match (whiteout, white_cell) {
                // The whiteout takes the source's entry in place: a lookup of the name
                // finds the source or the whiteout, never nothing.
                (Some((uid, gid)), Some(cell)) => {
                    // As any new inode (the kernel's inode_init_owner): a set-group-ID
                    // directory gives it its group.
                    let (dir_mode, dir_gid) = {
                        let d = m.inode(sp)?;
                        (d.d.mode, d.d.gid)
                    };
                    let gid = if dir_mode & perm::S_ISGID != 0 { dir_gid } else { gid };
                    let w = m.new_inode(cell, uid, gid, Place::Near(sp))?;
                    m.update(w, |n| {
                        n.d.nlink = 1;
                        n.d.rdev = 0;
                    })?;
                    m.dir_replace(sp, sname, w, ftype_of(f::S_IFCHR))?;
                }
                _ => m.dir_remove(sp, sname)?,
            }
            if src_dir && sp != dp {
                Self::lose_subdir(m, sp)?;
                m.inode(dp)?.d.nlink += 1;
                m.inode(src)?.d.parent = dp;
            }
            for ino in [sp, dp] {
                m.update(ino, |n| {
                    n.d.mtime = t;
                    n.d.ctime = t;
                })?;
            }
            m.update(src, |n| n.d.ctime = t)?;
            Ok(gone)
        })?;
        drop(m);
        if let Some(cell) = gone {
            self.free_after_change(&cell);
        }
        self.inner.maybe_commit();
        Ok(())
    }

    /// Directory entries from `offset` on ("." is 0, ".." is 1). Each entry carries
    /// the offset of the next one, stable while entries come and go.
    pub fn readdir(&self, ino: u64, offset: u64, max: usize) -> Result<Vec<DirEntry>> {
        self.inner.check_up()?;
        let mut m = self.meta();
        // As the kernel (IS_DEADDIR): a removed directory lists nothing, not even
        // "." and "..", whose parent may be gone.
        let dead = {
            let node = m.inode(ino)?;
            node.is_dir() && node.d.nlink == 0
        };
        if dead {
            return Ok(Vec::new());
        }
        let parent = m.dir_parent(ino)?;
        let mut out = Vec::new();
        if offset == 0 {
            out.push(DirEntry { ino, kind: FileType::Directory, name: b".".to_vec(), next: 1 });
        }
        if offset <= 1 && out.len() < max {
            out.push(DirEntry { ino: parent, kind: FileType::Directory, name: b"..".to_vec(), next: 2 });
        }
        let per = f::DIRENTS_PER_BLOCK as u64;
        let slots = m.dir(ino, |idx| idx.slots)?;
        let mut slot = offset.saturating_sub(2);
        while slot < slots && out.len() < max {
            let entries = m.dir_block_entries(ino, slot / per)?;
            for (i, e) in entries.into_iter().enumerate().skip((slot % per) as usize) {
                if out.len() >= max {
                    break;
                }
                slot = (slot / per) * per + i as u64 + 1;
                if let Some(e) = e {
                    out.push(DirEntry {
                        ino: e.ino,
                        kind: FileType::from_dirent(e.ftype),
                        name: e.name,
                        next: 2 + slot,
                    });
                }
            }
        }
        Ok(out)
    }

    pub fn statfs(&self) -> StatFs {
        let m = self.meta();
        StatFs {
            block_size: BLOCK_SIZE as u32,
            blocks: m.sb.data_blocks(),
            // Less what delayed allocations have promised, as ext4 counts its dirty
            // clusters.
            blocks_free: m.available() + m.alloc.pending_blocks(),
            blocks_available: m.available().saturating_sub(FsInner::meta_reserve(&m)),
            inodes: m.sb.inode_count,
            inodes_free: m.ifree,
            name_max: f::NAME_MAX as u32,
        }
    }

    /// Change attributes. A change of owner or group clears set-id bits of a
    /// non-directory (`perm::setid_to_clear`), as chown(2) does for anyone;
    /// `set.kill_setid` clears them too (a truncate by a caller without CAP_FSETID).
    /// An explicit `mode` is applied after that. A chmod of an inode with an access
    /// ACL moves the ACL's owner, mask (or group) and other entries along.
    pub fn setattr(&self, ino: u64, set: &SetAttr) -> Result<Metadata> {
        self.inner.check_writable()?;
        // As utimensat(2): nanoseconds past a second are EINVAL (and the inode would
        // not load again).
        let at = |t: Option<TimeSet>| match t {
            Some(TimeSet::At(ts) | TimeSet::Current(ts)) => Some(ts),
            _ => None,
        };
        if [at(set.atime), at(set.mtime), set.ctime].into_iter().flatten().any(|t| t.nsec >= 1_000_000_000) {
            return Err(Error::invalid("nanoseconds of a time past one second"));
        }
        if let Some(size) = set.size {
            self.truncate(ino, size)?;
        }
        let chown = set.uid.is_some() || set.gid.is_some();
        let (mut m, acl) = self.inner.admitted(|m| {
            let mut tx = m.inode_cost(ino, 0)?;
            // The new mode goes into the access ACL too: its block is rewritten.
            let mut blocks = 0;
            let acl = match set.mode {
                Some(_) if m.inode(ino)?.d.xattr_block != 0 => {
                    let mut entries = m.xattrs(ino)?;
                    match entries.iter().position(|(n, _)| n == perm::ACL_ACCESS) {
                        Some(i) => {
                            // The same size again (only the mask changes), in the current
                            // form (an attribute block of the first form may need one more).
                            let (cost, more) = m.xattr_cost(ino, &entries)?;
                            tx = tx.plus(cost);
                            blocks = more;
                            let acl = Acl::decode(&entries[i].1)?;
                            Some((entries.remove(i).0, acl, entries))
                        }
                        None => None,
                    }
                }
                _ => None,
            };
            Ok((Need::new(tx, blocks, false), acl))
        })?;
        let tx = m.tx.clone();
        let mut node = m.inode(ino)?;
        // As notify_change: no chmod, chown or explicit times on an immutable or
        // append-only file; setting the times to now is refused only when immutable.
        // As utimensat: "now" for one time while the other is left alone is explicit
        // too (ATTR_TIMES_SET; only both now at once is a touch), unless it comes with
        // a truncate (the time update of the size change itself).
        let explicit = |t: Option<TimeSet>| matches!(t, Some(TimeSet::At(_)));
        let now_alone = set.size.is_none()
            && matches!((set.atime, set.mtime), (Some(TimeSet::Now), None) | (None, Some(TimeSet::Now)));
        if set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || explicit(set.atime)
            || explicit(set.mtime)
            || now_alone
        {
            deny_change(&node)?;
        }
        if set.atime.is_some() || set.mtime.is_some() {
            deny_immutable(&node)?;
        }
        let t = now();
        if chown || set.kill_setid {
            let kill = perm::setid_to_clear(node.d.mode, set.outsider);
            node.d.mode &= !kill;
        }
        if let Some(mode) = set.mode {
            node.d.mode = (node.d.mode & f::S_IFMT) | (mode & 0o7777);
        }
        let mode_now = node.d.mode;
        if let Some(uid) = set.uid {
            node.d.uid = uid;
        }
        if let Some(gid) = set.gid {
            node.d.gid = gid;
        }
        let pick = |s: TimeSet| match s {
            TimeSet::Now => t,
            TimeSet::At(x) | TimeSet::Current(x) => x,
        };
        if let Some(a) = set.atime {
            node.d.atime = pick(a);
        }
        if let Some(mt) = set.mtime {
            node.d.mtime = pick(mt);
        }
        if set.mode.is_some()
            || chown
            || set.kill_setid
            || set.atime.is_some()
            || set.mtime.is_some()
            || set.ctime.is_some()
        {
            node.d.ctime = set.ctime.unwrap_or(t);
        }
        let md = attr(ino, &node);
        node.register(&tx, None);
        drop(node);
        if let Some((name, Some(mut acl), mut entries)) = acl {
            acl.chmod(mode_now);
            entries.push((name, acl.encode()));
            entries.sort();
            self.inner.mutate(&mut m, |m| m.set_xattrs(ino, entries))?;
        }
        drop(m);
        self.inner.maybe_commit();
        Ok(md)
    }

    /// What a write (or truncate) by a caller without CAP_FSETID does first, as the
    /// kernel's `file_remove_privs`: clear S_ISUID, and S_ISGID if group-executable or
    /// the caller is not in the file's group (`in_group(gid)`, asked only of a file
    /// whose S_ISGID has no group execute), of a file. Whether the caller is privileged
    /// is the caller's to know (FUSE: the kernel says so in the write request). Costs
    /// one look at the mode when there is nothing to clear. Returns whether it cleared
    /// something.
    pub fn remove_privs(&self, ino: u64, in_group: &dyn Fn(u32) -> bool) -> Result<bool> {
        let cell = self.inner.cell(ino)?;
        let (mode, gid) = {
            let node = cell.lock();
            (node.d.mode, node.d.gid)
        };
        let outsider = perm::sgid_asks_group(mode) && !in_group(gid);
        if perm::setid_to_clear(mode, outsider) == 0 {
            return Ok(false);
        }
        self.setattr(ino, &SetAttr { kill_setid: true, outsider, ..Default::default() })?;
        Ok(true)
    }

    /// What a change does first, as the kernel's `file_remove_privs`: a caller without
    /// CAP_FSETID (`setid`: which groups it is in) clears the set-ID bits
    /// (`remove_privs`), and any caller
    /// drops the file's capabilities (`perm::FILE_CAPS`), except at the write-back of
    /// pages the kernel cached (`PrivChange::CachedWrite`: their writer's change
    /// dropped them already, and a setcap since must stay). Looking for capabilities
    /// costs a read of the attributes once; then one atomic load per call, until a
    /// setxattr of that name. Nothing is cleared where the change itself will fail (an
    /// immutable file; an append-only one for `Attributes`); a write to an append-only
    /// file drops capabilities all the same, as the kernel's `cap_inode_killpriv`
    /// removes them without a setxattr's permission check. Returns whether it changed
    /// something.
    pub fn kill_privs(&self, ino: u64, setid: Option<&dyn Fn(u32) -> bool>, change: PrivChange) -> Result<bool> {
        let cell = self.inner.cell(ino)?;
        let caps = change != PrivChange::CachedWrite && !cell.caps_absent.load(std::sync::atomic::Ordering::Acquire);
        if cell.kind != f::S_IFREG || !(setid.is_some() || caps) {
            return Ok(false);
        }
        let refused = match change {
            PrivChange::Attributes => f::INODE_FLAG_IMMUTABLE | f::INODE_FLAG_APPEND,
            _ => f::INODE_FLAG_IMMUTABLE,
        };
        let (flags, mode, gid) = {
            let node = cell.lock();
            (node.d.flags, node.d.mode, node.d.gid)
        };
        if flags & refused != 0 {
            return Ok(false);
        }
        // As ext4: the set-ID bits a write or fallocate would clear are a mode change,
        // which an append-only file refuses (EPERM, the bits kept, the call not made).
        if let Some(in_group) = setid {
            let outsider = perm::sgid_asks_group(mode) && !in_group(gid);
            let append_only = flags & f::INODE_FLAG_APPEND != 0 && change != PrivChange::CachedWrite;
            if append_only && perm::setid_to_clear(mode, outsider) != 0 {
                return Err(Error::not_permitted("clearing set-ID bits of an append-only file"));
            }
        }
        let mut changed = match setid {
            Some(in_group) => self.remove_privs(ino, in_group)?,
            None => false,
        };
        if !caps {
            return Ok(changed);
        }
        let has = {
            let mut m = self.meta();
            let has = m.xattrs(ino)?.iter().any(|(n, _)| n == perm::FILE_CAPS);
            if !has {
                cell.caps_absent.store(true, std::sync::atomic::Ordering::Release);
            }
            has
        };
        if has {
            match self.drop_caps(ino) {
                Ok(()) => changed = true,
                Err(e) if e.errno() == libc::ENODATA => {}
                Err(e) => return Err(e),
            }
        }
        Ok(changed)
    }

    // ------------------------------------------------------------ extended attributes

    /// Names must carry a namespace Patchwork stores: user, trusted or security, or be
    /// one of the two POSIX ACLs (other system.* names: EOPNOTSUPP).
    fn check_xattr_name(name: &[u8]) -> Result<()> {
        if name == perm::ACL_ACCESS || name == perm::ACL_DEFAULT {
            return Ok(());
        }
        if name.is_empty() {
            return Err(Error::new(crate::ErrorKind::Range, "empty attribute name"));
        }
        if name.len() > f::XATTR_NAME_MAX {
            return Err(Error::new(crate::ErrorKind::Range, "attribute name too long"));
        }
        let known = [&b"user."[..], b"trusted.", b"security."];
        if known.contains(&name) {
            // A namespace with no name in it (the kernel's xattr_resolve_name).
            return Err(Error::invalid("attribute name without a name after its namespace"));
        }
        if !known.iter().any(|p| name.starts_with(p)) {
            return Err(Error::new(crate::ErrorKind::NotSupported, "attribute namespace not supported"));
        }
        Ok(())
    }

    pub fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        self.inner.check_up()?;
        Self::check_xattr_name(name)?;
        let mut m = self.meta();
        let entries = m.xattrs(ino)?;
        let found = entries.into_iter().find(|(n, _)| n == name);
        found.map(|(_, v)| v).ok_or_else(|| Error::new(crate::ErrorKind::NoData, ""))
    }

    pub fn listxattr(&self, ino: u64) -> Result<Vec<Vec<u8>>> {
        self.inner.check_up()?;
        Ok(self.meta().xattrs(ino)?.into_iter().map(|(n, _)| n).collect())
    }

    /// setxattr(2): `create` is XATTR_CREATE (EEXIST if present), `replace` is
    /// XATTR_REPLACE (ENODATA if absent). All attributes of an inode share one block:
    /// past that, ENOSPC (as ext4 when its in-inode and block space is full).
    ///
    /// A POSIX ACL is checked (EINVAL if malformed; a default ACL on anything but a
    /// directory is EACCES) and kept in canonical form; an access ACL sets the mode's
    /// permission bits (`posix_acl_update_mode`) and, when the mode says all it says,
    /// is not kept at all, as on ext4. An ACL without entries removes it.
    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], create: bool, replace: bool) -> Result<()> {
        self.setxattr_as(ino, name, value, create, replace, false)
    }

    /// `setxattr`; `drop_sgid`: an access ACL set by a caller outside the file's group
    /// and without CAP_FSETID also clears the set-group-ID bit (`posix_acl_update_mode`;
    /// the front end that knows the caller decides, as for chown).
    pub fn setxattr_as(
        &self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        create: bool,
        replace: bool,
        drop_sgid: bool,
    ) -> Result<()> {
        self.inner.check_writable()?;
        Self::check_xattr_name(name)?;
        if value.len() > f::XATTR_VALUE_MAX {
            return Err(Error::new(crate::ErrorKind::TooBig, "attribute value larger than 64 KiB"));
        }
        let is_acl = name == perm::ACL_ACCESS || name == perm::ACL_DEFAULT;
        let acl = if is_acl { Some(Acl::decode(value)?) } else { None };
        let (mut m, (entries, mode)) = self.inner.admitted(|m| {
            deny_change(&*m.inode(ino)?)?;
            let mut entries = m.xattrs(ino)?;
            let mut mode = None;
            // What is kept: the value, or (ACLs) its canonical form or nothing.
            let mut keep = Some(value.to_vec());
            if let Some(acl) = &acl {
                let node = m.inode(ino)?;
                if name == perm::ACL_DEFAULT && !node.is_dir() {
                    return Err(Error::new(crate::ErrorKind::AccessDenied, "default ACL on a non-directory"));
                }
                keep = acl.as_ref().map(Acl::encode);
                if let (Some(a), true) = (acl, name == perm::ACL_ACCESS) {
                    let sgid = if drop_sgid { perm::S_ISGID } else { 0 };
                    mode = Some((node.d.mode & !0o777 & !sgid) | a.mode_bits());
                    if a.is_mode() {
                        keep = None;
                    }
                }
            }
            match (entries.binary_search_by(|(n, _)| n.as_slice().cmp(name)), create, replace) {
                (Ok(_), true, _) => return Err(Error::exists("")),
                (Err(_), _, true) => return Err(Error::new(crate::ErrorKind::NoData, "")),
                (Ok(i), _, _) => match keep {
                    Some(v) => entries[i].1 = v,
                    None => drop(entries.remove(i)),
                },
                (Err(i), _, _) => {
                    if let Some(v) = keep {
                        // Every name must still fit one listxattr (XATTR_LIST_MAX): past
                        // it no program could list or copy the file's attributes. ext4
                        // stops far earlier (one block), with ENOSPC too.
                        let listed: usize = entries.iter().map(|(n, _)| n.len() + 1).sum();
                        if listed + name.len() + 1 > XATTR_LIST_MAX {
                            return Err(Error::no_space("the attribute names would not fit one listxattr"));
                        }
                        entries.insert(i, (name.to_vec(), v));
                    }
                }
            }
            let (tx, blocks) = m.xattr_cost(ino, &entries)?;
            Ok((Need::new(tx, blocks, false), (entries, mode)))
        })?;
        self.inner.mutate(&mut m, |m| {
            m.set_xattrs(ino, entries)?;
            if name == perm::FILE_CAPS {
                m.cell(ino)?.caps_absent.store(false, std::sync::atomic::Ordering::Release);
            }
            if let Some(mode) = mode {
                m.update(ino, |n| {
                    n.d.mode = mode;
                    n.d.ctime = now();
                })?;
            }
            Ok(())
        })?;
        drop(m);
        self.inner.maybe_commit();
        Ok(())
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> Result<()> {
        self.remove_xattr(ino, name, true)
    }

    /// The removal of file capabilities a change makes (the kernel's
    /// `cap_inode_killpriv`): as `removexattr` of `perm::FILE_CAPS`, but an
    /// append-only file does not refuse it (an immutable one does; ENODATA when there
    /// are none).
    pub fn drop_caps(&self, ino: u64) -> Result<()> {
        self.remove_xattr(ino, perm::FILE_CAPS, false)
    }

    /// removexattr(2), or (`checked` false) the removal a change makes of file
    /// capabilities, which only an immutable file refuses.
    fn remove_xattr(&self, ino: u64, name: &[u8], checked: bool) -> Result<()> {
        self.inner.check_writable()?;
        Self::check_xattr_name(name)?;
        let (mut m, entries) = self.inner.admitted(|m| {
            match checked {
                true => deny_change(&*m.inode(ino)?)?,
                false => deny_immutable(&*m.inode(ino)?)?,
            }
            let mut entries = m.xattrs(ino)?;
            let i = match entries.binary_search_by(|(n, _)| n.as_slice().cmp(name)) {
                Ok(i) => i,
                // Removing an ACL that is not there (the kernel's way of setting an
                // empty one, and what `cp -a` does) succeeds, as on ext4.
                Err(_) if name == perm::ACL_ACCESS || name == perm::ACL_DEFAULT => {
                    return Ok((Need::tx(TxSize::default()), None));
                }
                Err(_) => return Err(Error::new(crate::ErrorKind::NoData, "")),
            };
            entries.remove(i);
            let (tx, blocks) = m.xattr_cost(ino, &entries)?;
            Ok((Need::new(tx, blocks, false), Some(entries)))
        })?;
        let Some(entries) = entries else { return Ok(()) };
        self.inner.mutate(&mut m, |m| m.set_xattrs(ino, entries))?;
        drop(m);
        self.inner.maybe_commit();
        Ok(())
    }

    // ------------------------------------------------------------ file data

    /// Note an open handle (an unlinked inode lives until the last one is released).
    /// No metadata lock: the count lives with the inode.
    pub fn open_ino(&self, ino: u64) -> Result<Metadata> {
        self.inner.check_up()?;
        self.open_cell(ino).map(|(md, _)| md)
    }

    /// `open_ino`, also handing out the inode's cell (a `File` keeps it).
    pub(crate) fn open_cell(&self, ino: u64) -> Result<(Metadata, std::sync::Arc<InodeCell>)> {
        let cell = self.inner.cell(ino)?;
        let node = cell.lock();
        if node.freed {
            return Err(Error::not_found(format!("inode {ino} is not in use")));
        }
        // Without a name or a handle it is deleted (as after ext4's last iput), even
        // if freeing it was left to the commit: its pages may be dropped already, and
        // a block the journal carries would read as it was before its last fsync. (The
        // FUSE mount holds a handle for each kernel lookup, so the kernel never asks.)
        if node.d.nlink == 0 && cell.opens.load(std::sync::atomic::Ordering::Acquire) == 0 {
            return Err(Error::not_found(format!("inode {ino} was deleted")));
        }
        cell.opens.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let md = attr(ino, &node);
        drop(node);
        Ok((md, cell))
    }

    /// The last release of an unlinked inode hands it to the next commit to free (under
    /// the metadata lock, which `unlink` holds while it checks the count: one of the
    /// two sees the other).
    pub fn release_ino(&self, ino: u64) {
        let Ok(cell) = self.inner.cell(ino) else { return };
        self.release_cell(&cell);
    }

    /// `release_ino` of a cell the caller holds (a `File`: never another inode that
    /// got the number since).
    pub(crate) fn release_cell(&self, cell: &InodeCell) {
        use std::sync::atomic::Ordering;
        let ino = cell.ino;
        let last = cell.opens.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)) == Ok(1);
        // The link count is read under the inode's lock, which `drop_link` takes to
        // set it to 0 before it reads the open count: if this sees a link, the unlink
        // sees this release. A linked file is released without the metadata lock.
        let gone = || {
            let node = cell.lock();
            !node.freed && node.d.nlink == 0
        };
        if last && gone() {
            let mut m = self.meta();
            if cell.opens.load(Ordering::Acquire) == 0 && gone() {
                m.to_free.insert(ino);
                drop(m);
                // An error poisons the file system (the next call reports it), and
                // the inode stays listed for the commit.
                if let Err(e) = self.inner.free_now(cell) {
                    tracing::warn!("inode {ino}: freeing at its last release failed: {e}");
                }
            }
        }
    }

    /// Read up to `buf.len()` bytes at `offset`; returns the count (0 at EOF).
    pub fn read(&self, ino: u64, offset: u64, buf: &mut [u8]) -> Result<usize> {
        self.inner.check_up()?;
        let cell = self.inner.cell(ino)?;
        self.read_cell(&cell, &cell.ra, offset, buf)
    }

    /// `read` of a cell the caller holds, with its readahead state (a file handle's,
    /// or the inode's). A cached read takes no lock another reader of the file takes,
    /// but for a shard of the file's access lock.
    pub(crate) fn read_cell(&self, cell: &InodeCell, ra: &RaState, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let trace = Trace::begin(self.inner.config.trace_io);
        let n = self.read_data(cell, ra, offset, buf)?;
        trace.end(&self.inner.times.reads);
        if self.inner.config.atime {
            self.touch_atime(cell);
        }
        Ok(n)
    }

    /// The relatime rule (Config::atime): the access time moves to now if it is not
    /// after the modification or change time, or is a day old. Best effort: skipped on
    /// a read-only file system, for noatime files, and when the running transaction
    /// has no room left (a read never waits for a commit).
    fn touch_atime(&self, cell: &InodeCell) {
        if self.inner.check_writable().is_err() {
            return;
        }
        let mut node = cell.lock();
        if node.freed || node.d.flags & f::INODE_FLAG_NOATIME != 0 {
            return;
        }
        let (t, a) = (now(), node.d.atime);
        let key = |t: f::Timespec| (t.sec, t.nsec);
        let stale =
            key(a) <= key(node.d.mtime) || key(a) <= key(node.d.ctime) || t.sec.saturating_sub(a.sec) >= 24 * 3600;
        if !stale {
            return;
        }
        node.d.atime = t;
        if !node.register(&self.inner.tx, Some(self.inner.tx_room())) {
            node.d.atime = a;
        }
    }

    /// `read`, with the bytes handed to `f` as slices of the cached pages (ready for a
    /// writev) instead of copied into a buffer: a FUSE reply goes to the kernel
    /// straight from the cache.
    /// `f` runs with the file's access lock held for reading (writers of the file
    /// wait) and the pages locked; it must not call back into the engine. When a page
    /// cannot be had at once (write-back holds it, or it is served from patches), the
    /// bytes are copied, and `f` gets them as one slice. Empty at the end of file.
    ///
    /// `kept`: the caller keeps what it reads in a cache of its own (a FUSE mount whose
    /// kernel caches file data). Then the pages of a sequential stream are dropped
    /// behind it once handed over (`PageCache::drop_behind`): a second copy of a
    /// stream costs the sweep that evicts it later and the room meanwhile. Measured on
    /// cold 1 MiB sequential reads through the mount: 1.5-1.7 GB/s kept, 1.7-1.9
    /// dropped behind (docs/BENCHMARKS.md). Random and first reads stay cached.
    pub fn read_with<R>(
        &self,
        ino: u64,
        offset: u64,
        len: usize,
        kept: bool,
        f: impl FnOnce(&[IoSlice<'_>]) -> R,
    ) -> Result<R> {
        self.inner.check_up()?;
        let cell = self.inner.cell(ino)?;
        let trace = Trace::begin(self.inner.config.trace_io);
        let stream = kept && cell.ra.continues(offset);
        let (g, prepared) = self.read_pages(&cell, &cell.ra, offset, len)?;
        // Before the reply: a stat that follows the read sees the new access time.
        if self.inner.config.atime {
            self.touch_atime(&cell);
        }
        let r = match prepared {
            None => f(&[]),
            Some((pages, len)) => self.lend_pages(ino, &pages, offset, len, f)?,
        };
        drop(g);
        // Whole pages only: the next read of a stream that is not page-aligned starts
        // in the last one.
        let (first, end) = (offset.div_ceil(BLOCK), (offset + len as u64) / BLOCK);
        if stream && end > first {
            self.inner.cache.drop_behind(ino, first, end - first);
        }
        trace.end(&self.inner.times.reads);
        Ok(r)
    }

    /// `read_with`'s hand-over: each page made readable first (as `read` does, locks
    /// let go in between), then all of them locked at once without waiting (never
    /// two pages waited for while one is held: no lock order to keep), or else
    /// copied.
    fn lend_pages<R>(
        &self,
        ino: u64,
        pages: &[Arc<Page>],
        offset: u64,
        len: usize,
        f: impl FnOnce(&[IoSlice<'_>]) -> R,
    ) -> Result<R> {
        let mut scratch = [0u8; BLOCK_SIZE];
        let mut direct = true;
        let mut done = 0;
        for p in pages {
            let pos = offset + done as u64;
            let in_page = (pos % BLOCK) as usize;
            let n = (BLOCK_SIZE - in_page).min(len - done);
            // A page its patches can serve is read by the copy (and counted there).
            let g = p.wait();
            if g.state == PageState::Outdated && g.patches_cover(in_page, n) {
                direct = false;
                break;
            }
            drop(g);
            // Patches no longer grow here (writers wait for the access lock), so the
            // page is waited for or resolved, not served from them.
            if self.ready_page(ino, p, in_page, &mut scratch[..n])?.is_none() {
                direct = false;
                break;
            }
            done += n;
        }
        let guards: Option<Vec<_>> = if direct { pages.iter().map(|p| p.try_lock()).collect() } else { None };
        let readable = |g: &PageData| g.buf.is_some() && !g.failed && g.state != PageState::Outdated;
        if let Some(guards) = guards.filter(|gs| gs.iter().all(|g| readable(g))) {
            let mut slices = Vec::with_capacity(guards.len());
            let mut done = 0;
            for g in &guards {
                let in_page = ((offset + done as u64) % BLOCK) as usize;
                let n = (BLOCK_SIZE - in_page).min(len - done);
                slices.push(IoSlice::new(&g.data()[in_page..in_page + n]));
                done += n;
            }
            return Ok(f(&slices));
        }
        let mut buf = vec![0u8; len];
        let n = self.copy_pages(ino, pages, offset, &mut buf)?;
        Ok(f(&[IoSlice::new(&buf[..n])]))
    }

    /// Wait until `p` is readable: its guard, or None when the bytes at `in_page`
    /// (`out.len()` of them) were served from its patches into `out` (non-blocking
    /// writes: a page whose patches hold every byte asked for is not fetched).
    fn ready_page<'p>(
        &self,
        ino: u64,
        p: &'p Arc<Page>,
        in_page: usize,
        out: &mut [u8],
    ) -> Result<Option<parking_lot::MutexGuard<'p, PageData>>> {
        let mut g = p.wait();
        if g.state == PageState::Outdated {
            if g.read_patches(in_page, out) {
                self.inner.stats.reads_from_patches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Ok(None);
            }
            drop(g);
            self.inner.resolve(ino, vec![p.clone()])?;
            g = p.wait();
        }
        if g.failed {
            return Err(Error::io("read of a page failed"));
        }
        Ok(Some(g))
    }

    /// Copy `buf.len()` bytes at `offset` out of `pages` (the pages of that range, in
    /// order), each waited for or served from its patches.
    fn copy_pages(&self, ino: u64, pages: &[Arc<Page>], offset: u64, buf: &mut [u8]) -> Result<usize> {
        let len = buf.len();
        let mut done = 0;
        for p in pages {
            let pos = offset + done as u64;
            let in_page = (pos % BLOCK) as usize;
            let n = (BLOCK_SIZE - in_page).min(len - done);
            if let Some(g) = self.ready_page(ino, p, in_page, &mut buf[done..done + n])? {
                buf[done..done + n].copy_from_slice(&g.data()[in_page..in_page + n]);
            }
            done += n;
        }
        Ok(done)
    }

    fn read_data(&self, cell: &InodeCell, ra: &RaState, offset: u64, buf: &mut [u8]) -> Result<usize> {
        match self.read_pages(cell, ra, offset, buf.len())? {
            (_g, None) => Ok(0),
            (_g, Some((pages, len))) => self.copy_pages(cell.ino, &pages, offset, &mut buf[..len]),
        }
    }

    /// The pages of a read of `len` bytes at `offset` (`read_prepare`) and the file's
    /// access lock held for reading, for the caller to copy them under. The pages this
    /// read puts on the device are waited for without the lock, and the range looked
    /// at again under it: a writer of the file does not wait for a reader's device
    /// read (as for readahead and the fetcher: a truncate finds such pages in the cache
    /// and waits for them), while a read still never sees half of a write. None when
    /// there is nothing to read.
    #[allow(clippy::type_complexity)]
    fn read_pages<'c>(
        &self,
        cell: &'c InodeCell,
        ra: &RaState,
        offset: u64,
        len: usize,
    ) -> Result<(ReadGuard<'c, ()>, Option<(Vec<Arc<Page>>, usize)>)> {
        let g = cell.io.read();
        let (mut held, misses) = match self.read_prepare(cell, Some(ra), offset, len, false)? {
            Prepared::Nothing => return Ok((g, None)),
            Prepared::Pages(pages, len) => return Ok((g, Some((pages, len)))),
            Prepared::Misses(pages, misses) => (pages, misses),
        };
        drop(g);
        match misses {
            Misses::Started(s) => self.inner.finish_fetch(s)?,
            Misses::Fetch(pages) => self.inner.fetch(cell.ino, pages)?,
            Misses::Busy(pages) => pages.iter().for_each(|p| drop(p.wait())),
        }
        // The second look: the pages of the first (held, so not evicted), if the cache
        // still has them and the range is no longer (a truncate, punch or collapse
        // took them, a write grew the file); else a whole new look. The first look
        // counted and aged them: this one does not again.
        let g = cell.io.read();
        let again = match self.read_span(cell, offset, len)? {
            None => None,
            Some(n) => {
                let pages = (offset + n as u64 - 1) / BLOCK - offset / BLOCK + 1;
                if pages as usize <= held.len()
                    && self.inner.cache.holds(cell.ino, offset / BLOCK, &held[..pages as usize])
                {
                    held.truncate(pages as usize);
                    Some((held, n))
                } else {
                    match self.read_prepare(cell, None, offset, len, true)? {
                        Prepared::Nothing => None,
                        Prepared::Pages(pages, n) => Some((pages, n)),
                        Prepared::Misses(..) => unreachable!("read_prepare waits for its misses when told to"),
                    }
                }
            }
        };
        Ok((g, again))
    }

    /// The bytes a read of `len` at `offset` gets (cut at the end of file), None when
    /// none: with the caller holding the file's access lock for reading.
    fn read_span(&self, cell: &InodeCell, offset: u64, len: usize) -> Result<Option<usize>> {
        if cell.freed() {
            return Err(Error::not_found(format!("inode {} is not in use", cell.ino)));
        }
        if cell.is_dir() {
            return Err(Error::is_dir(""));
        }
        let size = cell.size();
        if offset >= size || len == 0 {
            return Ok(None);
        }
        Ok(Some((len as u64).min(size - offset) as usize))
    }

    /// The pages of a read of `len` bytes at `offset`, with the caller holding the
    /// file's access lock for reading: cached ones, the others put on the device
    /// (readahead started too, when `ra` is given), and the length cut at the end of
    /// file. With `wait`, the pages put on the device are waited for here; without,
    /// they are handed back to the caller to wait for (`Prepared::Misses`).
    fn read_prepare(
        &self,
        cell: &InodeCell,
        ra: Option<&RaState>,
        offset: u64,
        len: usize,
        wait: bool,
    ) -> Result<Prepared> {
        let ino = cell.ino;
        let Some(len) = self.read_span(cell, offset, len)? else {
            return Ok(Prepared::Nothing);
        };
        let (first, last) = (offset / BLOCK, (offset + len as u64 - 1) / BLOCK);
        if let Some(ra) = ra {
            self.inner.readahead(ino, ra, offset, len as u64, cell.size());
        }
        cell.note_pages(last + 1);
        // The asynchronous path reads a request's pages in one batch; a request of more
        // than 256 pages takes the chunked path (pages readable a chunk at a time).
        if self.inner.config.stack == Stack::Async && last - first < 256 {
            return match self.inner.read_pages_start(cell, first, last - first + 1)? {
                (pages, None) => Ok(self.found(pages, len, wait)),
                (pages, Some(s)) if wait => {
                    self.inner.finish_fetch(s)?;
                    Ok(Prepared::Pages(pages, len))
                }
                (pages, Some(s)) => Ok(Prepared::Misses(pages, Misses::Started(s))),
            };
        }
        let mut pages = Vec::with_capacity((last - first + 1) as usize);
        let mut missing = Vec::new();
        for (p, new) in self.inner.cache.get_or_insert_range(ino, first, last - first + 1) {
            if new {
                missing.push(p.clone());
            }
            pages.push(p);
        }
        if missing.is_empty() {
            return Ok(self.found(pages, len, wait));
        }
        if wait {
            self.inner.fetch(ino, missing)?;
            return Ok(Prepared::Pages(pages, len));
        }
        Ok(Prepared::Misses(pages, Misses::Fetch(missing)))
    }

    /// A read's pages, all found in the cache: without `wait`, those still on their
    /// way from the device for another thread (readahead, another reader, the fetcher)
    /// are handed back to be waited for without the file's lock, as the read's own
    /// misses are. (A page whose lock is held just now counts as readable.)
    fn found(&self, pages: Vec<Arc<Page>>, len: usize, wait: bool) -> Prepared {
        let arriving = |p: &Arc<Page>| {
            p.try_lock().is_some_and(|g| g.buf.is_none() && !g.failed && g.state != PageState::Outdated)
        };
        let busy: Vec<Arc<Page>> =
            if wait { Vec::new() } else { pages.iter().filter(|p| arriving(p)).cloned().collect() };
        if busy.is_empty() {
            return Prepared::Pages(pages, len);
        }
        Prepared::Misses(pages, Misses::Busy(busy))
    }

    /// Write `data` at `offset` (or at the end of file when `append`); returns the
    /// offset written at and the bytes written: all of them, or fewer when an error
    /// (no space, a failed read of a page) or the largest file size stopped the write
    /// after it had written some (as write(2) returns a short count; nothing written:
    /// the error).
    pub fn write(&self, ino: u64, offset: u64, data: &[u8], append: bool) -> Result<(u64, usize)> {
        let cell = self.inner.cell(ino)?;
        self.write_cell(&cell, offset, data, append)
    }

    /// `write` of a cell the caller holds. A large write goes in pieces of 4 MiB, each
    /// admitted into the journal on its own (what one piece reserves always fits).
    pub(crate) fn write_cell(&self, cell: &InodeCell, offset: u64, data: &[u8], append: bool) -> Result<(u64, usize)> {
        const PIECE: usize = 4 << 20;
        // One hold of the file's lock for all pieces: another append must not land
        // between two of them (and be overwritten by the next).
        let written = {
            let _g = cell.io.write();
            let first = data.len().min(PIECE);
            let (start, mut done) = self.write_locked(cell, offset, &data[..first], append)?;
            if done == first {
                for piece in data[first..].chunks(PIECE) {
                    // An error after bytes were written ends the write short; the
                    // next write meets it again.
                    match self.write_locked(cell, start + done as u64, piece, false) {
                        Ok((_, n)) if n == piece.len() => done += n,
                        Ok((_, n)) => {
                            done += n;
                            break;
                        }
                        Err(_) => break,
                    }
                }
            }
            (start, done)
        };
        // A commit the write made due runs after the file's lock is let go.
        self.inner.maybe_commit();
        Ok(written)
    }

    /// A write of at most one piece, with the file's lock (`io`, for writing) held by
    /// the caller, and without the commit it may make due (`maybe_commit`: the
    /// caller's, after the lock).
    pub(super) fn write_locked(
        &self,
        cell: &InodeCell,
        offset: u64,
        data: &[u8],
        append: bool,
    ) -> Result<(u64, usize)> {
        let ino = cell.ino;
        self.inner.check_writable()?;
        // `end`: short of the data's end where the largest file size cuts it.
        let (size, offset, end, stamp, (reserved, converting)) =
            self.begin_write(cell, offset, data.len() as u64, append)?;
        if end == offset {
            return Ok((offset, 0));
        }
        let (first, last) = (offset / BLOCK, (end - 1) / BLOCK);
        let mut copied = 0usize;
        cell.note_pages(last + 1);
        let pages = self.inner.cache.get_or_insert_range(ino, first, last - first + 1);
        let mut result = Ok(());
        let mut dirtied = first;
        // Every page dirtied so far is in the dirty set already (a page written again
        // before write-back took it): no need to list them.
        let mut listed = true;
        let nbw = self.inner.config.fetch != crate::FetchPolicy::Blocking;
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let mut pages = pages.into_iter().zip(first..);
        for ((p, new), idx) in pages.by_ref() {
            let pstart = idx * BLOCK;
            let from = offset.max(pstart);
            let to = end.min(pstart + BLOCK);
            let (n, at) = ((to - from) as usize, (from - pstart) as usize);
            let chunk = &data[copied..copied + n];
            let whole = from == pstart && to == pstart + BLOCK;
            if new {
                // A whole-page write or a page at or past EOF needs no read. Any other
                // partial write to a page not in memory becomes a patch and returns at
                // once (non-blocking writes), or reads the page first (Blocking, or when
                // patch memory is full).
                if whole {
                    let g = p.lock();
                    p.complete(g, self.inner.dev.alloc(BLOCK_SIZE));
                } else if pstart >= size {
                    let g = p.lock();
                    p.complete(g, self.inner.dev.alloc_zeroed(BLOCK_SIZE));
                } else if nbw && self.inner.patch_room(n) && self.inner.patch_page_room() {
                    let mut g = p.lock();
                    g.state = PageState::Outdated;
                    let delta = g.add_patch(at, chunk);
                    drop(g);
                    p.notify();
                    self.inner.stats.patch_bytes.fetch_add(delta as i64, relaxed);
                    self.inner.stats.patched_pages.fetch_add(1, relaxed);
                    self.inner.stats.patches_created.fetch_add(1, relaxed);
                    self.inner.stats.fetches_deferred.fetch_add(1, relaxed);
                    match self.inner.config.fetch {
                        crate::FetchPolicy::AsyncForeground => self.inner.start_fetch_for_writer(ino, p.clone()),
                        crate::FetchPolicy::AsyncBackground => self.inner.queue_fetch(ino, idx),
                        _ => {}
                    }
                    copied += n;
                    listed = false;
                    dirtied = idx + 1;
                    continue;
                } else {
                    if nbw {
                        self.inner.stats.patch_memory_fallbacks.fetch_add(1, relaxed);
                    }
                    self.inner.stats.fetches_for_partial_write.fetch_add(1, relaxed);
                    if let Err(e) = self.inner.fetch(ino, vec![p.clone()]) {
                        result = Err(e);
                        break;
                    }
                }
            }
            // The page's data is on its way (its read started): the write joins it as
            // a patch, applied in order when the data arrives, instead of waiting.
            let mut g = p.lock();
            if nbw && g.state == PageState::Fetching && !g.failed && self.inner.patch_room(n) {
                let (count, first) = (g.patches.len(), g.patches.is_empty());
                let delta = g.add_patch(at, chunk);
                let merged = !first && g.patches.len() <= count;
                let c = if merged { &self.inner.stats.patches_merged } else { &self.inner.stats.patches_created };
                c.fetch_add(1, relaxed);
                self.inner.stats.patch_bytes.fetch_add(delta as i64, relaxed);
                if first {
                    self.inner.stats.patched_pages.fetch_add(1, relaxed);
                }
                copied += n;
                listed = false;
                dirtied = idx + 1;
                continue;
            }
            drop(g);
            let mut g = p.wait();
            if g.state == PageState::Outdated {
                if self.inner.patch_room(n) {
                    let count = g.patches.len();
                    let delta = g.add_patch(at, chunk);
                    let merged = g.patches.len() <= count;
                    let c = if merged { &self.inner.stats.patches_merged } else { &self.inner.stats.patches_created };
                    c.fetch_add(1, relaxed);
                    self.inner.stats.patch_bytes.fetch_add(delta as i64, relaxed);
                    // Every byte now written: the page needs no fetch at all.
                    if g.patches.len() == 1 && g.patches[0].data.len() == BLOCK_SIZE {
                        let full = g.patches.pop().expect("one patch");
                        let mut buf = self.inner.dev.alloc(BLOCK_SIZE);
                        buf.copy_from_slice(&full.data);
                        g.buf = Some(buf);
                        g.state = PageState::Dirty;
                        drop(g);
                        p.notify();
                        self.inner.stats.patch_bytes.fetch_sub(BLOCK_SIZE as i64, relaxed);
                        self.inner.stats.patched_pages.fetch_sub(1, relaxed);
                        self.inner.stats.fetches_avoided.fetch_add(1, relaxed);
                    }
                    copied += n;
                    listed = false;
                    dirtied = idx + 1;
                    continue;
                }
                drop(g);
                self.inner.stats.patch_memory_fallbacks.fetch_add(1, relaxed);
                if let Err(e) = self.inner.resolve(ino, vec![p.clone()]) {
                    result = Err(e);
                    break;
                }
                g = p.wait();
            }
            if g.failed {
                result = Err(Error::io("fetch of a page for a partial write failed"));
                break;
            }
            g.data_mut()[at..at + n].copy_from_slice(chunk);
            g.state = PageState::Dirty;
            drop(g);
            listed &= p.listed();
            copied += n;
            dirtied = idx + 1;
        }
        // Pages this write put in the cache and did not get to (an earlier page's fetch
        // failed) are nobody's to fill: they leave the cache, and their waiters get EIO.
        for ((p, new), _) in pages {
            if new {
                self.inner.cache.fail(&p);
            }
        }
        // What this write reserved, or began converting, for the pages it did not
        // write (from the one that failed on) goes back: no write-back will use it. A
        // page there that was in the cache already (a hole read as zeros) stays clean,
        // and kept its reservation for good before. Other writers wait for this
        // file's lock, so nothing else was added for these pages meanwhile.
        let unreserve: Vec<u64> = reserved.into_iter().filter(|i| *i >= dirtied).collect();
        let unconvert: Vec<u64> = converting.into_iter().filter(|i| *i >= dirtied).collect();
        if !unreserve.is_empty() || !unconvert.is_empty() {
            let mut m = self.meta();
            let mut node = cell.lock();
            let n = unreserve.iter().filter(|i| node.reserved.remove(i)).count() as i64;
            for i in &unconvert {
                node.converting.remove(i);
            }
            drop(node);
            m.add_reserved(-n);
        }
        // Every page changed so far goes to write-back, even when a later one failed;
        // marked dirty before the new size is published, and, for a write that grows
        // the file, both under the size gate, which a commit holds from choosing its
        // data to closing its transaction: no commit stores a size over pages it did
        // not see dirty. (Write-back outside a commit that finds such a page past the
        // old end keeps it dirty, see `prepare_writeback`.)
        let _gate = (end > size).then(|| self.inner.size_gate.read());
        if !listed {
            self.inner.cache.mark_dirty_range(ino, first, dirtied);
            cell.dirtied_in.store(
                self.inner.wb_round.load(std::sync::atomic::Ordering::Relaxed),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        // The size covers what was copied.
        let copied_end = offset + copied as u64;
        if let Some(t) = stamp {
            let mut node = cell.lock();
            node.pins -= 1;
            if copied > 0 {
                if copied_end > node.d.size {
                    node.d.size = copied_end;
                    node.data_meta_dirty = true;
                }
                node.d.mtime = t;
                node.d.ctime = t;
                // Registered when the write began; a commit since then kept it
                // registered for the next transaction (it was pinned), unless that
                // commit is storing it right now.
                if node.tx_epoch != self.inner.tx.epoch() {
                    node.register(&self.inner.tx, None);
                }
            }
        }
        drop(_gate);
        match result {
            // Bytes written before the error: a short write (write(2) reports the
            // error only when it wrote nothing).
            Err(e) if copied == 0 => Err(e),
            _ => Ok((offset, copied)),
        }
    }

    /// Admit a write of `len` bytes: check it, reserve space for pages that have no
    /// block yet (delayed allocation), and pin the inode in the running transaction
    /// with room for what the write changes (the caller unpins it when done). A write
    /// within allocated blocks takes only the inode's lock (and the transaction's the
    /// first time the inode changes in it); one that reserves space takes the
    /// metadata lock too. Returns the size before, the offset (end of file when
    /// `append`), the end of the write, and the time its modification and change
    /// times take — None when the write changes no metadata: it stays within the file,
    /// needs no new reservation or conversion (its pages have blocks, or have them
    /// reserved or being converted already), and its time is the inode's already
    /// (timestamps move at the kernel's coarse clock, as ext4's do). Such a write is
    /// not pinned, and adds nothing to the running transaction.
    fn begin_write(
        &self,
        cell: &InodeCell,
        offset: u64,
        len: u64,
        append: bool,
    ) -> Result<(u64, u64, u64, Option<f::Timespec>, Needs)> {
        let ino = cell.ino;
        let check = |node: &Inode| -> Result<(u64, u64, u64, Needs)> {
            if node.freed {
                return Err(Error::not_found(format!("inode {ino} is not in use")));
            }
            if node.is_dir() {
                return Err(Error::is_dir(""));
            }
            let size = node.d.size;
            deny_write(node, offset, append)?;
            let offset = if append { size } else { offset };
            // As Linux: a write that starts below the largest file size writes what
            // fits below it; one at or past it (with data) fails with EFBIG.
            if offset >= f::MAX_FILE_SIZE && len > 0 {
                return Err(Error::file_too_big(""));
            }
            let end = offset.saturating_add(len).min(f::MAX_FILE_SIZE);
            let len = end - offset;
            if len == 0 {
                return Ok((size, offset, end, Default::default()));
            }
            let (first, last) = (offset / BLOCK, (end - 1) / BLOCK);
            let need = (first..=last).filter(|i| node.map(*i).is_none() && !node.reserved.contains(i)).collect();
            let conv = match node.extents.is_empty() {
                true => Vec::new(),
                false => (first..=last).filter(|i| node.is_unwritten(*i) && !node.converting.contains(i)).collect(),
            };
            Ok((size, offset, end, (need, conv)))
        };
        loop {
            let mut node = cell.lock();
            let (size, offset, end, (need, conv)) = check(&node)?;
            if len == 0 {
                return Ok((size, offset, end, None, Needs::default()));
            }
            let t = write_time(&node);
            if need.is_empty() && conv.is_empty() {
                if end <= size && node.d.mtime == t && node.d.ctime == t {
                    return Ok((size, offset, end, None, Needs::default()));
                }
                if node.register(&self.inner.tx, Some(self.inner.tx_room())) {
                    node.pins += 1;
                    return Ok((size, offset, end, Some(t), Needs::default()));
                }
                drop(node);
                self.inner.commit()?;
                continue;
            }
            drop(node);
            // Space to reserve: under the metadata lock, with room promised for the
            // inode (an extent per new page at worst, two per unwritten page) and the
            // bitmap blocks that write-back changes to allocate them.
            let (mut m, ()) = self.inner.admitted(|m| {
                let (need, conv) = check(&*m.inode(ino)?)?.3;
                let (n, c) = (need.len() as u64, conv.len() as u64);
                let tx = m.inode_cost(ino, n + 2 * c)?.plus(TxSize::new(n.min(m.sb.block_bitmap_blocks), 0));
                // A write into fallocated blocks is not refused for the reserve (`splits`
                // false): fallocate promised it room (posix_fallocate), as ext4 keeps
                // by converting from its reserved pool.
                Ok((Need::new(tx, n, false), ()))
            })?;
            let tx = m.tx.clone();
            let mut node = m.inode(ino)?;
            let (size, offset, end, (need, conv)) = check(&node)?;
            let n = need.len() as u64;
            node.reserved.extend(need.iter().copied());
            node.converting.extend(conv.iter().copied());
            node.pins += 1;
            node.register(&tx, None);
            let t = write_time(&node);
            drop(node);
            m.add_reserved(n as i64);
            return Ok((size, offset, end, Some(t), (need, conv)));
        }
    }

    /// Set the size: drop or zero what lies past it, or extend with a hole.
    pub fn truncate(&self, ino: u64, size: u64) -> Result<()> {
        self.inner.check_writable()?;
        if size > f::MAX_FILE_SIZE {
            return Err(Error::file_too_big(""));
        }
        let cell = self.inner.cell(ino)?;
        let _g = cell.io.write();
        let (m, old) = self.inner.admitted(|m| {
            let node = m.inode(ino)?;
            if node.is_dir() {
                return Err(Error::is_dir(""));
            }
            if node.kind() != f::S_IFREG {
                return Err(Error::invalid("truncate of a special file"));
            }
            deny_change(&node)?;
            let old = node.d.size;
            // The inode (its tail page may move: one more extent, one more bitmap
            // block) and the bitmap blocks of what is cut off.
            let keep = size.div_ceil(BLOCK);
            let unmap = m.unmap_cost(&node, keep.saturating_sub(1));
            // Its extent chain may shrink to nothing: freed (bitmap blocks) and revoked.
            let chain = node.chain.len() as u64;
            drop(node);
            let shrink = TxSize::new(chain.min(m.sb.block_bitmap_blocks), chain);
            let tx = m.inode_cost(ino, 1)?.plus(TxSize::new(1 + unmap, 0)).plus(shrink);
            Ok((Need::tx(tx), old))
        })?;
        // Promised until the change is made: the pages are dealt with first, without
        // the metadata lock.
        let credit = m.keep_credit();
        let r = self.truncate_admitted(&cell, size, old);
        drop(credit);
        r?;
        drop(_g);
        self.inner.maybe_commit();
        Ok(())
    }

    /// The truncate, admitted: room in the transaction is promised to it.
    fn truncate_admitted(&self, cell: &InodeCell, size: u64, old: u64) -> Result<()> {
        let ino = cell.ino;
        if size < old {
            // No write-back between the drop, the zeroing and the change of the block
            // map (as `clear_blocks`): else it could write the zeroed tail page in
            // place into its old block, leaving the page clean with only a reservation
            // once the block is unmapped below, never written to a new one — the
            // tail's data gone after a later fsync — or place a dropped page past the
            // new end.
            let _c = self.inner.commit_lock.lock();
            let keep = size.div_ceil(BLOCK);
            // Bytes past EOF in the last block stay zero on disk and in cache. A tail
            // page in a hole (no block, nothing reserved) is zeros already.
            // A tail page with a block moves; one still waiting for its first block
            // (promised when it was written) needs none more.
            let (zeroed, moved) = match size.is_multiple_of(BLOCK) {
                true => (false, false),
                false => {
                    let (n, idx) = (cell.lock(), size / BLOCK);
                    let hole = n.map_data(idx).is_none() && !n.reserved.contains(&idx) && !n.converting.contains(&idx);
                    // An unwritten (fallocated) block reads as zeros until the commit
                    // that marks it written, which carries this truncate too: it is
                    // zeroed in place.
                    (!hole, !hole && n.map_data(idx).is_some())
                }
            };
            if zeroed {
                let idx = size / BLOCK;
                cell.note_pages(idx + 1);
                let (p, new) = self.inner.cache.get_or_insert((ino, idx));
                if new {
                    self.inner.fetch(ino, vec![p.clone()])?;
                }
                let mut g = p.wait();
                if g.state == PageState::Outdated {
                    drop(g);
                    self.inner.resolve(ino, vec![p.clone()])?;
                    g = p.wait();
                }
                if g.failed {
                    return Err(Error::io("fetch of the last page failed"));
                }
                drop(g);
                // The zeroed tail page must not overwrite its block in place: until
                // this truncate commits, a crash would show the old size with zeros
                // in it. It moves to a new block (the old one is freed with the
                // truncate), promised now, before anything changes: on a full device
                // from the metadata reserve (the truncate gives a block back), as long
                // as half of the reserve stays for the commits' extent chains; past
                // that the truncate is refused (ENOSPC) with the file as it was. (The
                // block map cannot change meanwhile: the file's access lock and the
                // commit lock are held.)
                if moved {
                    let mut m = self.meta();
                    let mut commits = 0;
                    while m.available() <= FsInner::meta_reserve(&m) / 2 {
                        // Space freed by earlier changes comes back with their commits
                        // (as `admit` waits for it).
                        if commits == 3 || (m.alloc.pending_blocks() == 0 && m.to_free.is_empty()) {
                            return Err(Error::no_space("no free block for the cut last block of the file"));
                        }
                        drop(m);
                        self.inner.commit_locked()?;
                        commits += 1;
                        m = self.meta();
                    }
                    m.add_reserved(1);
                }
                // Nothing else changes the page meanwhile (the same two locks).
                let mut g = p.lock();
                g.data_mut()[(size % BLOCK) as usize..].fill(0);
                g.state = PageState::Dirty;
                drop(g);
                self.inner.cache.mark_dirty((ino, idx));
            }
            // The pages past the new end go only now: a failed read of the tail page
            // above fails the truncate with the file as it was, dirty pages included.
            let dropped = self.inner.cache.drop_from(ino, keep, cell.pages_end());
            self.inner.forget_pages(dropped);
            let mut m = self.meta();
            self.inner.mutate(&mut m, |m| {
                let mut node = match m.inode(ino) {
                    Ok(node) => node,
                    Err(e) => {
                        // The promise goes back (the file system stops on this error).
                        m.add_reserved(-(moved as i64));
                        return Err(e);
                    }
                };
                let mut freed = node.unmap_from(keep);
                let mut reserved = 0i64;
                if moved {
                    // The zeroed tail moves: its block promised above.
                    freed.extend(node.unmap_range(keep - 1, keep));
                    node.converting.remove(&(keep - 1));
                    node.reserved.insert(keep - 1);
                }
                reserved -= node.forget_pages(keep, u64::MAX) as i64;
                // The size goes with the unmapping, in one change: a commit between
                // the two would log blocks freed by an inode that still maps them.
                node.d.size = size;
                m.finish_data_change(node, reserved, freed)
            })?;
            return Ok(());
        }
        let mut m = self.meta();
        m.update(ino, |node| {
            node.d.size = size;
            let t = now();
            node.d.mtime = t;
            node.d.ctime = t;
            node.data_meta_dirty = true;
        })
    }

    /// fsync/fdatasync: every write before it is durable when it returns.
    ///
    /// fsync commits the whole running transaction (names included). fdatasync of a
    /// file whose size and block map did not change since the last commit only writes
    /// the data in place and flushes: times need not be durable (POSIX), so a durable
    /// overwrite costs one data write and one flush, with no journal I/O.
    pub fn fsync(&self, ino: u64, datasync: bool) -> Result<()> {
        self.fsync_reporting(ino, datasync, None)
    }

    /// `fsync` for a handle that remembers the losses it reported (`since`): each
    /// handle reports a lost write once (errseq), not only the first to ask.
    pub(crate) fn fsync_reporting(&self, ino: u64, datasync: bool, since: Option<&AtomicU64>) -> Result<()> {
        let trace = Trace::begin(self.inner.config.trace_io);
        let r = self.fsync_inner(ino, datasync);
        trace.end(&self.inner.times.fsyncs);
        self.report_lost_writes(ino, since)?;
        self.inner.sync_result(r)
    }

    /// close(2) of a handle (FUSE `flush`): reports, once, a lost write of this file
    /// that is already known. It does not wait for fetches still in flight (close
    /// never waits for I/O); a loss found later is kept for the next fsync or close.
    pub fn flush(&self, ino: u64) -> Result<()> {
        self.flush_reporting(ino, None)
    }

    /// `flush` for a handle that remembers the losses it reported (`fsync_reporting`).
    pub(crate) fn flush_reporting(&self, ino: u64, since: Option<&AtomicU64>) -> Result<()> {
        self.inner.check_up()?;
        self.report_lost_writes(ino, since)
    }

    /// What a new handle of `ino` has reported of its lost writes: all of them if they
    /// were reported before, none if one was not (a handle opened after an unreported
    /// loss reports it, as Linux does since 4.16).
    pub(crate) fn lost_writes_sample(&self, ino: u64) -> u64 {
        if !self.inner.any_lost.load(std::sync::atomic::Ordering::Acquire) {
            return 0;
        }
        match self.inner.fetch_errors.lock().get(&ino) {
            Some(e) if e.seen => e.seq,
            _ => 0,
        }
    }

    /// Writes that returned before their page could be read, and whose read then
    /// failed, are reported (EIO) by the next fsync or close of each handle open then
    /// (`since`: the count of losses the handle reported, advanced here), errseq-style,
    /// never dropped. A caller without a handle (`Fs::fsync` by number, a FUSE mount
    /// that sees no opens) reports a loss no one has reported yet.
    fn report_lost_writes(&self, ino: u64, since: Option<&AtomicU64>) -> Result<()> {
        // The loss is recorded before the operation that found it returns (the store
        // is under the lock, and reported by whoever then calls here).
        if !self.inner.any_lost.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        let mut errors = self.inner.fetch_errors.lock();
        let Some(e) = errors.get_mut(&ino) else {
            return Ok(());
        };
        let new = match since {
            Some(s) => s.swap(e.seq, std::sync::atomic::Ordering::Relaxed) != e.seq,
            None => !e.seen,
        };
        if !new {
            return Ok(());
        }
        e.seen = true;
        Err(Error::io("data written earlier was lost: reading its page failed"))
    }

    fn fsync_inner(&self, ino: u64, datasync: bool) -> Result<()> {
        // A directory's data is its entries, which live in the journal: fdatasync of
        // one commits them, as fsync does (skipping the commit lost the names made in
        // it, a new directory block included).
        if !datasync || self.inner.cell(ino)?.kind == f::S_IFDIR {
            return self.inner.commit_shared(ino);
        }
        self.inner.check_alive()?;
        let ticket = self.inner.fsync_ticket(ino);
        let _c = self.inner.commit_lock.lock();
        // Checked again now that the lock is held: the commit or write-back this call
        // waited behind may have failed after taking this file's pages and changes
        // (they look clean and committed from here, and are not durable).
        self.inner.check_alive()?;
        if self.inner.covered(ticket) {
            return Ok(());
        }
        // This file's pages only: write-back may allocate (and so set
        // `data_meta_dirty`), which then needs the commit, which writes whatever else
        // that commit stores.
        let kept = self.inner.hitch.kept.load(std::sync::atomic::Ordering::Relaxed);
        let file = [ino].into();
        self.inner.writeback_for(Some(&file), crate::writeback::Wb::Sync(&file))?;
        // A page the journal carries (hitchhiking) is not written in place: the
        // commit carries it.
        let carried = self.inner.hitch.kept.load(std::sync::atomic::Ordering::Relaxed) != kept;
        if carried || self.inner.cell(ino)?.lock().data_meta_dirty {
            return self.inner.commit_locked_for(Some(ino));
        }
        // Nothing written since the last flush (a commit's, or an earlier fdatasync's):
        // everything is durable already (the kernel's FSYNC after an O_DSYNC write the
        // front end already made durable, say).
        if !self.inner.take_unflushed() {
            return self.inner.check_alive();
        }
        crate::aios::submitting();
        self.inner.dev.flush().map_err(|e| self.inner.poison(e.into()))?;
        crate::aios::completed();
        Ok(())
    }
}

/// The modification and change time a data write gives its inode: the kernel's coarse
/// clock (what ext4 stamps writes with: it moves once a tick), never before the
/// inode's change time (set by a finer clock, or by an earlier write), so that times
/// do not go backwards. Writes within one tick change no metadata after the first.
/// (Should the clock step back, writes keep the inode's change time, and so change no
/// metadata, until the clock passes it again.)
fn write_time(node: &Inode) -> f::Timespec {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a plain call with a valid out-pointer.
    let coarse = if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
        f::Timespec { sec: ts.tv_sec, nsec: ts.tv_nsec as u32 }
    } else {
        now()
    };
    let c = node.d.ctime;
    if (coarse.sec, coarse.nsec) < (c.sec, c.nsec) {
        c
    } else {
        coarse
    }
}
