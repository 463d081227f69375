//! The decider's step of the miss hook: what it said, made into a grant,
//! an approval or a denial.

use super::grants::{Scope, Target, DEFAULT_TTL};
use super::{Jit, Miss, MissFacts, Terms};
use crate::config::{ApproverToken, TokenDigest};
use crate::decider::{Answer, Decider, Question, Said};
use crate::policy::Policy;
use crate::proto::target::Host;

/// The approver a decider's grant is given as.
pub(crate) const APPROVER: &str = "decider";

/// A miss put to the decider (the miss hook's step between a grant and
/// `on_miss = "ask"`): what it became, and what was said. An allow is a
/// grant of the target given as approver `decider` (its `ttl`, or a
/// single use without one), then spent as any grant; an ask an approval;
/// anything else (a deny, an error, a timeout, busy) a denial.
pub(crate) async fn consult(
    decider: &Decider,
    jit: &Jit,
    policy: &Policy,
    facts: &MissFacts<'_>,
) -> (Miss, Said) {
    let host = facts.host.to_string();
    let question = Question {
        org: &facts.org.name,
        client: facts.client.to_string(),
        host: &host,
        port: facts.port,
        mode: facts.mode.as_str(),
        method: facts.request.map(|r| r.method),
        path: facts.request.map(|r| r.path.as_str()),
    };
    let said = decider.consult(&question).await;
    let miss = match said.decision {
        Answer::Deny => Miss::Denied,
        Answer::Ask => jit.ask(facts).map_or(Miss::Denied, Miss::Pending),
        Answer::Allow => {
            let token = ApproverToken {
                name: APPROVER.to_string(),
                digest: TokenDigest([0; 32]),
                orgs: Some(vec![facts.org.name.to_string()]),
            };
            let scope = Scope {
                org: facts.org.name.clone(),
                target: match facts.host {
                    Host::Name(n) => Target::Name(n.clone()),
                    Host::Ip(ip) => Target::Cidr(ipnet::IpNet::from(*ip)),
                },
                port: facts.port,
                // A request's allow opens that method on that path, no wider.
                method: facts.request.map(|r| r.method.to_string()),
                path: facts.request.map(|r| r.path.as_str().to_string()),
            };
            // Without a ttl, one use: spent at once by a connection; a
            // DNS answer spends none, so there the grant also ends after
            // the default TTL if no connection comes.
            let ttl = said.ttl();
            let terms = Terms {
                ttl: ttl.or(facts.port.is_none().then_some(DEFAULT_TTL)),
                max_uses: ttl.is_none().then_some(1),
                reason: Some(APPROVER.to_string()),
            };
            // A grant the scope checks refuse (an always-denied address)
            // stays a denial, as for an approver.
            match jit
                .give(&token, scope, terms, None, policy, facts.now)
                .await
            {
                Ok(_) => jit.grant_for(facts).map_or(Miss::Denied, Miss::Granted),
                Err(_) => Miss::Denied,
            }
        }
    };
    (miss, said)
}
