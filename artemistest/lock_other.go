//go:build !unix

package artemistest

import (
	"context"
	"errors"
)

// lockFile: mode Local is for Unix only (see runLocal).
func lockFile(context.Context, string) (func(), error) { return nil, errors.ErrUnsupported }
