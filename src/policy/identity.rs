//! Which org a client belongs to: its address, and the credentials it
//! presented (the identity table of the module doc).

use std::net::IpAddr;

use crate::config::{Identity, TokenDigest};

use super::compile::{canonical, Org, Policy};
use super::verdict::{OrgRef, Reason};

/// Credentials a client presented: the user (an org name) and its token.
#[derive(Clone, Copy)]
pub struct Credential<'a> {
    pub user: &'a [u8],
    pub token: &'a [u8],
}

/// Why a client's identity could not be established.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// No credentials, and the address alone selects no org (row I2).
    #[error("credentials required")]
    Required,
    /// Credentials that do not verify (row I6); the cause is for evidence
    /// only, never for the client.
    #[error("credentials rejected: {0}")]
    Failed(&'static str),
}

impl IdentityError {
    pub fn reason(self) -> Reason {
        match self {
            IdentityError::Required => Reason::AuthRequired,
            IdentityError::Failed(_) => Reason::AuthFailed,
        }
    }
}

impl Policy {
    /// The org a client address belongs to (longest prefix wins).
    pub fn org_for(&self, client: IpAddr) -> Option<OrgRef> {
        let client = canonical(client);
        let index = self.clients.matches(client).find_map(|o| *o)?;
        self.orgs.get(index).map(|o| o.r#ref.clone())
    }

    /// The org of a client that presented `credential` (or none): the
    /// identity table above. Presented credentials are always checked.
    pub fn org_for_identity(
        &self,
        client: IpAddr,
        credential: Option<Credential<'_>>,
    ) -> Result<Option<OrgRef>, IdentityError> {
        let client = canonical(client);
        let Some(cred) = credential else {
            return match self.org_for(client) {
                Some(org) => Ok(Some(org)),
                None if self.orgs.iter().any(|o| accepts_from(o, client)) => {
                    Err(IdentityError::Required)
                }
                None => Ok(None),
            };
        };
        self.org_for_token(client, cred.user, &TokenDigest::of(cred.token))
    }

    /// The org of a live connection under this policy: found again from
    /// the identity it was decided with (its address; for a token org, the
    /// digest of the token it presented, `token`), and only if that is
    /// still the org `was`. `None`: the connection has no org here.
    pub fn org_again(
        &self,
        client: IpAddr,
        was: &OrgRef,
        token: Option<&TokenDigest>,
    ) -> Option<OrgRef> {
        let client = canonical(client);
        let found = match token {
            None => self.org_for(client),
            Some(digest) => self
                .org_for_token(client, was.name.as_bytes(), digest)
                .ok()
                .flatten(),
        };
        found.filter(|org| org.name == was.name)
    }

    /// The identity table's rows for a presented token (`user` names the
    /// org), given as its digest.
    fn org_for_token(
        &self,
        client: IpAddr,
        user: &[u8],
        presented: &TokenDigest,
    ) -> Result<Option<OrgRef>, IdentityError> {
        // Hash and compare whether or not the org exists, so that the time
        // taken says little about which it is.
        let org = std::str::from_utf8(user)
            .ok()
            .and_then(|name| self.by_name.get(name))
            .and_then(|&i| self.orgs.get(i));
        let dummy = [TokenDigest([0u8; 32])];
        let stored = org.map_or(&dummy[..], |o| &o.tokens[..]);
        let mut matched = false;
        for digest in stored {
            matched |= presented.ct_eq(digest);
        }
        let Some(org) = org else {
            return Err(IdentityError::Failed("no such org"));
        };
        match org.identity {
            Identity::Address => Err(IdentityError::Failed("org is identified by address")),
            _ if !matched => Err(IdentityError::Failed("wrong token")),
            Identity::AddressToken if !accepts_from(org, client) => {
                Err(IdentityError::Failed("address is not in the org's clients"))
            }
            Identity::Token | Identity::AddressToken => Ok(Some(org.r#ref.clone())),
        }
    }
}

/// Would `org` accept a token presented from `client`?
fn accepts_from(org: &Org, client: IpAddr) -> bool {
    match org.identity {
        Identity::Address => false,
        Identity::Token => true,
        Identity::AddressToken => org.networks.iter().any(|n| n.contains(&client)),
    }
}
