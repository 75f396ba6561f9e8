//! Permission rules the engine applies itself, as ext4 gets them from the kernel's VFS:
//! set-id bits cleared by writes, truncates and chown; set-group-ID directories passed
//! on to what is created in them; POSIX ACLs (their xattr form, the mode they imply,
//! and what a new inode inherits from its directory's default ACL).
//!
//! Interface: pure functions on modes and ACLs; `ops` calls them under the inode's lock.
//! Who is privileged is decided by the caller, who knows (the FUSE front end from the
//! kernel's request, an embedder from its own credentials): see [`Creator`] and
//! `Fs::remove_privs`. The engine still checks no permission (the kernel does, with
//! the ACLs it reads from here).

use crate::error::{Error, Result};
use crate::format as f;

pub const S_ISUID: u32 = 0o4000;
pub const S_ISGID: u32 = 0o2000;
pub const S_IXGRP: u32 = 0o0010;

/// The xattr names under which the access and the default ACL are kept.
pub const ACL_ACCESS: &[u8] = b"system.posix_acl_access";
pub const ACL_DEFAULT: &[u8] = b"system.posix_acl_default";
/// File capabilities (setcap(8)): a write or truncate by anyone drops them, as the
/// kernel's `file_remove_privs` does (`Fs::kill_privs`).
pub const FILE_CAPS: &[u8] = b"security.capability";

/// Who creates an inode, as far as its owner and mode depend on it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Creator {
    pub uid: u32,
    /// The creator's (filesystem) group: the new inode's group, unless its directory
    /// is set-group-ID.
    pub gid: u32,
    /// Supplementary groups: with `gid`, whether the creator is in a set-group-ID
    /// directory's group (or it loses S_ISGID from the mode it asks for).
    pub groups: Vec<u32>,
    /// CAP_FSETID: keeps S_ISGID in that case.
    pub fsetid: bool,
    /// umask(2): cleared from the mode unless the directory has a default ACL (which
    /// masks the mode instead). 0 when the caller applied it already.
    pub umask: u32,
}

impl Creator {
    /// A creator with no supplementary groups and no umask; root has CAP_FSETID.
    pub fn new(uid: u32, gid: u32) -> Creator {
        Creator { uid, gid, groups: Vec::new(), fsetid: uid == 0, umask: 0 }
    }

    fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

/// The set-id bits a write or truncate by a caller without CAP_FSETID, or a chown by
/// anyone, clears from a file that is not a directory (the kernel's
/// `should_remove_suid` and, since Linux 6.2, `setattr_should_drop_sgid`): S_ISUID
/// always; S_ISGID with S_IXGRP, and without it (where it marks mandatory locking)
/// only for an `outsider`, a caller neither in the file's group nor holding
/// CAP_FSETID.
pub fn setid_to_clear(mode: u32, outsider: bool) -> u32 {
    if mode & f::S_IFMT == f::S_IFDIR {
        return 0;
    }
    let mut kill = mode & S_ISUID;
    if mode & S_ISGID != 0 && (mode & S_IXGRP != 0 || outsider) {
        kill |= S_ISGID;
    }
    kill
}

/// Whether [`setid_to_clear`] of `mode` depends on the caller's groups: S_ISGID
/// without group execute on a file that is not a directory.
pub fn sgid_asks_group(mode: u32) -> bool {
    mode & f::S_IFMT != f::S_IFDIR && mode & (S_ISGID | S_IXGRP) == S_ISGID
}

/// Owner and mode of a new inode in a directory of `dir_mode`/`dir_gid`, before ACLs
/// (the kernel's `inode_init_owner` and `mode_strip_sgid`): in a set-group-ID
/// directory the inode takes the directory's group, and a new directory is
/// set-group-ID too; a file asking for S_ISGID|S_IXGRP there keeps S_ISGID only if its
/// creator is in that group or has CAP_FSETID.
pub fn new_owner(dir_mode: u32, dir_gid: u32, mode: u32, who: &Creator) -> (u32, u32) {
    if dir_mode & S_ISGID == 0 {
        return (mode, who.gid);
    }
    let is_dir = mode & f::S_IFMT == f::S_IFDIR;
    let mut mode = mode;
    if is_dir {
        mode |= S_ISGID;
    } else if mode & (S_ISGID | S_IXGRP) == S_ISGID | S_IXGRP && !who.in_group(dir_gid) && !who.fsetid {
        mode &= !S_ISGID;
    }
    (mode, dir_gid)
}

// ------------------------------------------------------------ POSIX ACLs

/// The version word of the xattr form (`posix_acl_xattr_header`).
const ACL_VERSION: u32 = 2;
const UNDEFINED_ID: u32 = u32::MAX;

/// Entry tags, in the order a valid ACL lists them.
pub const ACL_USER_OBJ: u16 = 0x01;
pub const ACL_USER: u16 = 0x02;
pub const ACL_GROUP_OBJ: u16 = 0x04;
pub const ACL_GROUP: u16 = 0x08;
pub const ACL_MASK: u16 = 0x10;
pub const ACL_OTHER: u16 = 0x20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AclEntry {
    pub tag: u16,
    /// rwx as 4/2/1.
    pub perm: u16,
    /// A user or group id for ACL_USER and ACL_GROUP; unused otherwise.
    pub id: u32,
}

/// A valid ACL: one owner, owning-group and other entry, named users and groups in
/// id order without repeats, and a mask whenever there is a named entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acl(Vec<AclEntry>);

impl Acl {
    /// Decode and check the xattr form (little-endian: a version word, then 8-byte
    /// entries of tag, permissions and id). `Ok(None)`: no entries (the kernel's way of
    /// saying "no ACL"). Anything malformed is EINVAL.
    pub fn decode(value: &[u8]) -> Result<Option<Acl>> {
        let bad = |why: &str| Error::invalid(format!("POSIX ACL: {why}"));
        if value.len() < 4 || !(value.len() - 4).is_multiple_of(8) {
            return Err(bad("size is not a header plus whole entries"));
        }
        if u32::from_le_bytes(value[..4].try_into().expect("4 bytes")) != ACL_VERSION {
            return Err(bad("unknown version"));
        }
        let mut entries = Vec::with_capacity((value.len() - 4) / 8);
        for e in value[4..].chunks_exact(8) {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            let perm = u16::from_le_bytes([e[2], e[3]]);
            let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
            let id = if tag == ACL_USER || tag == ACL_GROUP { id } else { UNDEFINED_ID };
            entries.push(AclEntry { tag, perm, id });
        }
        if entries.is_empty() {
            return Ok(None);
        }
        Acl::check(&entries).map_err(bad)?;
        Ok(Some(Acl(entries)))
    }

    /// The kernel's `posix_acl_valid`: the owner, named users, the owning group, named
    /// groups, the mask (required with named entries), other, in that order of tags,
    /// each of the four single tags once. Named ids are neither sorted nor unique there,
    /// so not here either (ext4 stores such an ACL as given).
    fn check(entries: &[AclEntry]) -> std::result::Result<(), &'static str> {
        #[derive(PartialEq)]
        enum State {
            UserObj,
            User,
            Group,
            Other,
            Done,
        }
        let mut state = State::UserObj;
        let mut needs_mask = false;
        for e in entries {
            if e.perm & !7 != 0 {
                return Err("permissions other than rwx");
            }
            state = match (e.tag, state) {
                (ACL_USER_OBJ, State::UserObj) => State::User,
                (ACL_USER, State::User) => {
                    needs_mask = true;
                    State::User
                }
                (ACL_GROUP_OBJ, State::User) => State::Group,
                (ACL_GROUP, State::Group) => {
                    needs_mask = true;
                    State::Group
                }
                (ACL_MASK, State::Group) => State::Other,
                (ACL_OTHER, State::Other) => State::Done,
                (ACL_OTHER, State::Group) if !needs_mask => State::Done,
                (ACL_USER_OBJ | ACL_USER | ACL_GROUP_OBJ | ACL_GROUP | ACL_MASK | ACL_OTHER, _) => {
                    return Err("entries out of order, repeated, or named entries without a mask")
                }
                _ => return Err("unknown entry tag"),
            };
        }
        if state != State::Done {
            return Err("no other entry, or entries missing before it");
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 8 * self.0.len());
        out.extend_from_slice(&ACL_VERSION.to_le_bytes());
        for e in &self.0 {
            out.extend_from_slice(&e.tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
        }
        out
    }

    pub fn entries(&self) -> &[AclEntry] {
        &self.0
    }

    fn perm(&self, tag: u16) -> Option<u32> {
        self.0.iter().find(|e| e.tag == tag).map(|e| e.perm as u32)
    }

    fn set(&mut self, tag: u16, perm: u32) {
        if let Some(e) = self.0.iter_mut().find(|e| e.tag == tag) {
            e.perm = (perm & 7) as u16;
        }
    }

    /// Whether a mode says all this ACL says (three entries only: nothing to keep).
    pub fn is_mode(&self) -> bool {
        self.0.len() == 3
    }

    /// The permission bits this ACL implies (`posix_acl_update_mode`): owner, mask
    /// (or owning group without one), other.
    pub fn mode_bits(&self) -> u32 {
        let group = self.perm(ACL_MASK).or(self.perm(ACL_GROUP_OBJ)).unwrap_or(0);
        (self.perm(ACL_USER_OBJ).unwrap_or(0) << 6) | (group << 3) | self.perm(ACL_OTHER).unwrap_or(0)
    }

    /// chmod of an inode with this access ACL (`posix_acl_chmod`): the owner, mask (or
    /// owning group) and other entries take the new permission bits.
    pub fn chmod(&mut self, mode: u32) {
        self.set(ACL_USER_OBJ, mode >> 6);
        let group = if self.perm(ACL_MASK).is_some() { ACL_MASK } else { ACL_GROUP_OBJ };
        self.set(group, mode >> 3);
        self.set(ACL_OTHER, mode);
    }

    /// The access ACL a new inode of `mode` gets from its directory's default ACL, and
    /// the mode cut down to it (`posix_acl_create`): each of owner, mask (or owning
    /// group) and other keeps only what both the ACL and the mode grant. The umask does
    /// not apply.
    pub fn inherit(&self, mode: u32) -> (Acl, u32) {
        let mut acl = self.clone();
        let mut bits = mode & 0o777;
        let group = if acl.perm(ACL_MASK).is_some() { ACL_MASK } else { ACL_GROUP_OBJ };
        for (tag, shift) in [(ACL_USER_OBJ, 6), (group, 3), (ACL_OTHER, 0)] {
            let p = acl.perm(tag).unwrap_or(0) & (bits >> shift) & 7;
            acl.set(tag, p);
            bits = (bits & !(7 << shift)) | (p << shift);
        }
        (acl, (mode & !0o777) | bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        let a = Acl(entries.iter().map(|&(tag, perm, id)| AclEntry { tag, perm, id }).collect());
        a.encode()
    }

    #[test]
    fn setid_rule_follows_should_remove_suid() {
        for outsider in [false, true] {
            assert_eq!(setid_to_clear(f::S_IFREG | 0o4755, outsider), S_ISUID);
            assert_eq!(setid_to_clear(f::S_IFREG | 0o2755, outsider), S_ISGID);
            assert_eq!(setid_to_clear(f::S_IFREG | 0o6777, outsider), S_ISUID | S_ISGID);
            assert_eq!(setid_to_clear(f::S_IFDIR | 0o6777, outsider), 0);
        }
        // S_ISGID without group execute (mandatory locking): kept for a member of the
        // file's group (or a holder of CAP_FSETID), cleared for anyone else.
        assert_eq!(setid_to_clear(f::S_IFREG | 0o2745, false), 0);
        assert_eq!(setid_to_clear(f::S_IFREG | 0o2745, true), S_ISGID);
        assert!(sgid_asks_group(f::S_IFREG | 0o2745));
        assert!(!sgid_asks_group(f::S_IFREG | 0o2755));
        assert!(!sgid_asks_group(f::S_IFDIR | 0o2745));
    }

    #[test]
    fn set_group_id_directories_pass_on_their_group() {
        let who = Creator::new(1000, 1000);
        assert_eq!(new_owner(f::S_IFDIR | 0o755, 50, f::S_IFREG | 0o644, &who), (f::S_IFREG | 0o644, 1000));
        assert_eq!(new_owner(f::S_IFDIR | 0o2775, 50, f::S_IFREG | 0o644, &who), (f::S_IFREG | 0o644, 50));
        assert_eq!(new_owner(f::S_IFDIR | 0o2775, 50, f::S_IFDIR | 0o755, &who), (f::S_IFDIR | 0o2755, 50));
        // Not in the group: S_ISGID dropped from a group-executable file ...
        assert_eq!(new_owner(f::S_IFDIR | 0o2775, 50, f::S_IFREG | 0o2755, &who), (f::S_IFREG | 0o755, 50));
        // ... kept by a member, by CAP_FSETID, and without group execute.
        let member = Creator { groups: vec![50], ..who.clone() };
        assert_eq!(new_owner(f::S_IFDIR | 0o2775, 50, f::S_IFREG | 0o2755, &member).0, f::S_IFREG | 0o2755);
        assert_eq!(new_owner(f::S_IFDIR | 0o2775, 50, f::S_IFREG | 0o2755, &Creator::new(0, 0)).0, f::S_IFREG | 0o2755);
        assert_eq!(new_owner(f::S_IFDIR | 0o2775, 50, f::S_IFREG | 0o2745, &who).0, f::S_IFREG | 0o2745);
    }

    #[test]
    fn bad_acls_are_einval() {
        let good =
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_USER, 5, 7), (ACL_GROUP_OBJ, 5, 0), (ACL_MASK, 5, 0), (ACL_OTHER, 0, 0)]);
        assert!(Acl::decode(&good).unwrap().is_some());
        assert_eq!(Acl::decode(&2u32.to_le_bytes()).unwrap(), None);
        let bad = [
            good[..good.len() - 1].to_vec(),
            [&3u32.to_le_bytes()[..], &good[4..]].concat(),
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_GROUP_OBJ, 5, 0)]),
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_USER, 5, 7), (ACL_GROUP_OBJ, 5, 0), (ACL_OTHER, 0, 0)]),
            acl(&[(ACL_USER_OBJ, 8, 0), (ACL_GROUP_OBJ, 5, 0), (ACL_OTHER, 0, 0)]),
            acl(&[(ACL_GROUP_OBJ, 5, 0), (ACL_USER_OBJ, 7, 0), (ACL_OTHER, 0, 0)]),
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_GROUP_OBJ, 5, 0), (0x40, 5, 0), (ACL_OTHER, 0, 0)]),
            // A single tag twice, and anything after other.
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_USER_OBJ, 7, 0), (ACL_GROUP_OBJ, 5, 0), (ACL_OTHER, 0, 0)]),
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_GROUP_OBJ, 5, 0), (ACL_MASK, 5, 0), (ACL_MASK, 5, 0), (ACL_OTHER, 0, 0)]),
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_GROUP_OBJ, 5, 0), (ACL_OTHER, 0, 0), (ACL_OTHER, 0, 0)]),
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_GROUP_OBJ, 5, 0), (ACL_OTHER, 0, 0), (ACL_USER, 5, 7)]),
        ];
        for b in bad {
            assert_eq!(Acl::decode(&b).unwrap_err().errno(), libc::EINVAL, "{b:?}");
        }
        // Named ids repeated or unsorted: the kernel's rule (posix_acl_valid) checks the
        // order of tags only, and ext4 stores such an ACL as given.
        for ok in [
            acl(&[
                (ACL_USER_OBJ, 7, 0),
                (ACL_USER, 5, 7),
                (ACL_USER, 5, 7),
                (ACL_GROUP_OBJ, 5, 0),
                (ACL_MASK, 5, 0),
                (ACL_OTHER, 0, 0),
            ]),
            acl(&[
                (ACL_USER_OBJ, 7, 0),
                (ACL_USER, 5, 1000),
                (ACL_USER, 5, 100),
                (ACL_GROUP_OBJ, 5, 0),
                (ACL_GROUP, 5, 9),
                (ACL_GROUP, 5, 3),
                (ACL_MASK, 5, 0),
                (ACL_OTHER, 0, 0),
            ]),
            // A mask without named entries is allowed.
            acl(&[(ACL_USER_OBJ, 7, 0), (ACL_GROUP_OBJ, 5, 0), (ACL_MASK, 5, 0), (ACL_OTHER, 0, 0)]),
        ] {
            assert!(Acl::decode(&ok).unwrap().is_some(), "{ok:?}");
        }
    }

    #[test]
    fn mode_and_acl_stay_in_step() {
        let mut a = Acl::decode(&acl(&[
            (ACL_USER_OBJ, 7, 0),
            (ACL_USER, 7, 7),
            (ACL_GROUP_OBJ, 5, 0),
            (ACL_MASK, 6, 0),
            (ACL_OTHER, 4, 0),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(a.mode_bits(), 0o764);
        a.chmod(0o750);
        assert_eq!(a.mode_bits(), 0o750);
        // chmod moves the mask, not the owning group's entry.
        assert_eq!(a.perm(ACL_GROUP_OBJ), Some(5));
        assert_eq!(a.perm(ACL_USER), Some(7));
        // A new file asking for 0666 under this default: each class gets the overlap.
        let (child, mode) = a.inherit(f::S_IFREG | 0o666);
        assert_eq!(mode, f::S_IFREG | 0o640);
        assert_eq!(child.mode_bits(), 0o640);
        assert_eq!(child.perm(ACL_USER), Some(7));
    }
}
