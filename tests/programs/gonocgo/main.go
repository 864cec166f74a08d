// A Go program without cgo (statically linked when built with CGO_ENABLED=0, as by
// default without a C import): prints "hello".
package main

import "fmt"

func main() {
	fmt.Println("hello")
}
