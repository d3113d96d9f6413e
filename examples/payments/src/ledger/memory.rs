//! The ledger in memory (`--store memory`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use uuid::Uuid;

use super::{Applied, LedgerError, Operation};

/// The accounts, shared by clones.
#[derive(Clone, Debug, Default)]
pub(super) struct MemoryLedger {
    accounts: Arc<Mutex<HashMap<String, AccountState>>>,
}

#[derive(Debug, Default)]
struct AccountState {
    balance: i64,
    operations: u64,
}

impl MemoryLedger {
    pub(super) fn apply(&self, id: Uuid, operation: &Operation) -> Result<Applied, LedgerError> {
        // The map is consistent between statements: a panic elsewhere leaves it usable.
        let mut accounts = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        let account = accounts.entry(operation.account_id.clone()).or_default();
        let balance = account
            .balance
            .checked_add(operation.amount)
            .ok_or_else(|| LedgerError::Overflow {
                account_id: operation.account_id.clone(),
            })?;
        account.balance = balance;
        account.operations += 1;
        Ok(Applied { id, balance })
    }

    /// The balance and the operation count; `(0, 0)` for an unknown account.
    pub(super) fn account(&self, account_id: &str) -> (i64, u64) {
        let accounts = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        accounts
            .get(account_id)
            .map_or((0, 0), |account| (account.balance, account.operations))
    }
}
